"""End-to-end training throughput beside the paper's anchor (213B tokens/day on 64 H100).

The paper (PAPER.md "End to end"): the 7B MoE (sonic_7b preset: 40 layers, E 128, K 8, n 256)
trained with FSDP-2 does 213B tokens/day on 64 H100s, 3.33B per GPU per day; ScatterMoE 225B
on 96. What we have measured so far is bench/results/*-fsdp.json: 2 H200s, the same model cut
to 4 layers. Tokens per GPU per day of a 4-layer model are not comparable to 40 layers, so the
table also gives MFU (our FLOPs/token formula, sonic.models.flops_per_token) and, derived
from it, what the 40-layer model would do at the measured MFU; the 4-layer model spends about
half its FLOPs in the 100k-vocabulary head, so that is a rough estimate, not a measurement.

  python -m scripts.repro.e2e_throughput                                  # newest *-fsdp.json
  python -m scripts.repro.e2e_throughput --metrics runs/sonic_7b/metrics.jsonl   # a real run

The 64-GPU run (8 nodes x 8 H100):
  sbatch --nodes 8 --gpus-per-node 8 scripts/slurm/train.sbatch experiment=sonic_7b
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from scripts.repro import paper
from scripts.repro.common import (DOCS, fmt, load_json, md_table, newest, pyplot, read_jsonl, rel,
                                  save_figure, write_text)

PAPER_LAYERS = 40  # configs/model/sonic_7b.yaml, the lm-engine recipe PAPER.md points to
SEQ_LEN = 4096
SLURM_64 = "sbatch --nodes 8 --gpus-per-node 8 scripts/slurm/train.sbatch experiment=sonic_7b"


def flops_per_token(num_layers: int) -> float:
    from sonic.models import flops_per_token as fpt  # noqa: PLC0415 - keeps --help light
    from sonic.models.presets import load_preset  # noqa: PLC0415

    return fpt(load_preset("sonic_7b", num_layers=num_layers), SEQ_LEN)


def peak(device_name: str) -> float:
    """Dense bf16 peak FLOP/s for a device name, from the table the trainer's MFU uses."""
    from sonic.train.metrics import PEAK_BF16_FLOPS  # noqa: PLC0415

    return next(flops for key, flops in PEAK_BF16_FLOPS if key in device_name)


def short(device: str) -> str:
    """'2x NVIDIA H200 (143771 MiB each), ...' -> 'H200'."""
    from sonic.train.metrics import PEAK_BF16_FLOPS  # noqa: PLC0415

    return next((key for key, _ in PEAK_BF16_FLOPS if key in device), device.split(",")[0])


def at_40_layers(run: dict) -> float | None:
    """tokens/s/GPU of the 40-layer model at the run's MFU: the same FLOP/s over more FLOPs per token."""
    if run["layers"] == PAPER_LAYERS:
        return None
    return run["tokens_per_s_per_gpu"] * flops_per_token(run["layers"]) / flops_per_token(PAPER_LAYERS)


def per_gpu_day(tokens_per_s_per_gpu: float) -> float:
    return tokens_per_s_per_gpu * 86400 / 1e9


def steady(rows: list[dict], skip: int) -> dict:
    """Mean of the logged speed metrics after the first `skip` steps (compile / autotune warm-up)."""
    kept = [r for r in rows if r["step"] > skip and "tokens_per_s_per_gpu" in r]
    if not kept:
        raise SystemExit(f"no logged step after {skip}; lower --skip-steps")
    keys = ("tokens_per_s_per_gpu", "tokens_per_s", "btokens_per_day", "mfu", "mem_peak_gib")
    out = {k: sum(r[k] for r in kept) / len(kept) for k in keys if all(k in r for r in kept)}
    out["steps_averaged"] = f"{kept[0]['step']}-{kept[-1]['step']}"
    return out


def measured_runs(fsdp_json: Path | None, metrics: list[Path], layers: int, skip: int) -> list[dict]:
    runs = []
    if fsdp_json:
        payload = load_json(fsdp_json)
        for name, r in payload["runs"].items():
            m = re.search(r"model\.num_layers=(\d+)", r["command"])
            runs.append({"name": name, "layers": int(m.group(1)) if m else layers, "device": short(payload["device"]),
                         "source": fsdp_json, "command": r["command"], **r["steady_state"]})
    for path in metrics:
        runs.append({"name": path.parent.name, "layers": layers, "device": "GPU", "source": path,
                     "command": "", **steady(read_jsonl(path), skip)})
    return runs


def render(runs: list[dict], out_dir: Path, peak_name: str = "H100") -> str:
    fpt_paper = flops_per_token(PAPER_LAYERS)
    h100 = peak(peak_name)
    sonic = paper.E2E["sonicmoe"]
    paper_tps = sonic["btokens_per_gpu_day"] * 1e9 / 86400
    paper_mfu = paper_tps * fpt_paper / h100
    scatter_gpu_day = paper.E2E["scattermoe"]["btokens_per_day"] / paper.E2E["scattermoe"]["gpus"]
    table = [["paper: SonicMoE, 64 H100 (PAPER.md)", PAPER_LAYERS, fmt(paper_tps / 1e3, 1),
              f"{sonic['btokens_per_gpu_day']:.2f}", f"{sonic['btokens_per_day']} (64 GPUs)",
              f"{100 * paper_mfu:.1f}% (implied)", "–", "–"],
             ["paper: ScatterMoE, 96 H100 (PAPER.md)", PAPER_LAYERS, "–", f"{scatter_gpu_day:.2f}",
              f"{paper.E2E['scattermoe']['btokens_per_day']} (96 GPUs)", "–", "–", "–"]]
    for r in runs:
        gpus = round(r["tokens_per_s"] / r["tokens_per_s_per_gpu"]) if r.get("tokens_per_s") else "?"
        est = at_40_layers(r)
        table.append([f"Sonic {r['name']}, {gpus}× {r['device']}", r["layers"],
                      fmt(r["tokens_per_s_per_gpu"] / 1e3, 1), f"{per_gpu_day(r['tokens_per_s_per_gpu']):.2f}",
                      f"{r['btokens_per_day']:.1f} ({gpus} GPUs)", f"{100 * r['mfu']:.1f}%" if "mfu" in r else "–",
                      f"{per_gpu_day(est):.2f}" if est else "–", fmt(r.get("mem_peak_gib"), 1)])
    head_share = 1 - 4 * (fpt_paper - flops_per_token(4)) / (PAPER_LAYERS - 4) / flops_per_token(4)
    sources = sorted({rel(r["source"]) for r in runs})
    lines = ["# End-to-end training throughput (paper abstract: 213B tokens/day on 64 H100)", "",
             "Measured rows are steady-state means (warm-up window excluded) from: " +
             ", ".join(f"`{s}`" for s in sources) + ". The paper's rows are H100, 40 layers; ours are H200 "
             f"(same dense bf16 peak as the H100 SXM, {peak('H200') / 1e12:.0f} TFLOP/s, more memory bandwidth) and, for bench/results/*-fsdp.json, the "
             "7B model cut to 4 layers. MFU uses our FLOPs/token (6 × active matmul params + attention, "
             f"sonic.models.flops_per_token): {fpt_paper / 1e9:.2f} GFLOP/token for 40 layers at seq 4096, "
             f"{flops_per_token(4) / 1e9:.2f} for 4 (of which {100 * head_share:.0f}% is embedding/LM head "
             "and other non-layer work). 'Paper implied MFU' applies that formula to the paper's 3.33B/GPU/day. "
             "'40 layers at this MFU' is the measured MFU carried to the 40-layer FLOPs/token: an estimate.", "",
             md_table(table, ["run", "layers", "k tokens/s/GPU", "B tokens/GPU/day", "B tokens/day (job)", "MFU",
                              "est. B tokens/GPU/day, 40 layers at this MFU", "peak mem GiB"]), "",
             "Commands of the measured runs:", ""]
    lines += [f"- {r['name']}: `{r['command']}`" for r in runs if r["command"]]
    lines += ["", "The paper's configuration (64 GPUs = 8 nodes × 8; FSDP-2 over all 64, or HSDP with "
              "`parallel.dp_replicate=8`), not run yet:", "", f"```bash\n{SLURM_64}\n```", "",
              "Then `python -m scripts.repro.e2e_throughput --metrics runs/sonic_7b/metrics.jsonl` puts its "
              "steady state in this table (btokens_per_day in metrics.jsonl is for the whole job).", "",
              "![throughput](e2e_throughput.png)"]
    text = "\n".join(lines)
    write_text(out_dir / "e2e_throughput.md", text)
    plot(runs, paper_tps, paper_mfu, scatter_gpu_day, out_dir / "e2e_throughput.png")
    return text


def plot(runs, paper_tps, paper_mfu, scatter_gpu_day, path: Path) -> None:
    plt = pyplot()
    bars = [("paper SonicMoE, 64×H100, 40 L", per_gpu_day(paper_tps), "k", ""),
            ("paper ScatterMoE, 96×H100, 40 L", scatter_gpu_day, "grey", "")]
    for r in runs:
        bars.append((f"Sonic {r['name']}, {r['layers']} L, measured", per_gpu_day(r["tokens_per_s_per_gpu"]), "C0", ""))
        if at_40_layers(r):
            bars.append((f"Sonic {r['name']}, 40 L at its MFU (est.)", per_gpu_day(at_40_layers(r)), "white", "//"))
    mfus = [("paper SonicMoE (implied)", paper_mfu, "k")] + [
        (f"Sonic {r['name']}, {r['layers']} L", r["mfu"], "C0") for r in runs if "mfu" in r]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 1.2 + 0.45 * (len(bars) + len(mfus))),
                               gridspec_kw={"height_ratios": [len(bars), len(mfus)]})
    for i, (label, val, color, hatch) in enumerate(bars):
        a.barh(i, val, color=color, edgecolor="C0" if color == "white" else color, hatch=hatch)
        a.text(val, i, f" {val:.2f}", va="center", fontsize=8)
    a.set_yticks(range(len(bars)), [x[0] for x in bars], fontsize=8)
    a.invert_yaxis()
    a.set_xlabel("B tokens / GPU / day")
    a.set_title(f"Training throughput per GPU (ours: {', '.join(sorted({r['device'] for r in runs}))})", fontsize=10)
    for i, (label, val, color) in enumerate(mfus):
        b.barh(i, 100 * val, color=color)
        b.text(100 * val, i, f" {100 * val:.1f}%", va="center", fontsize=8)
    b.set_yticks(range(len(mfus)), [x[0] for x in mfus], fontsize=8)
    b.invert_yaxis()
    b.set_xlabel(f"MFU, % (our FLOPs/token formula; {peak('H100') / 1e12:.0f} TFLOP/s dense bf16 peak)")
    for ax in (a, b):
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlim(0, ax.get_xlim()[1] * 1.1)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fsdp-json", default=None, help="default: newest bench/results/*-fsdp.json ('none' to skip)")
    ap.add_argument("--metrics", nargs="*", default=[], help="metrics.jsonl of sonic_7b training runs")
    ap.add_argument("--layers", type=int, default=PAPER_LAYERS, help="--metrics runs: model.num_layers")
    ap.add_argument("--skip-steps", type=int, default=10, help="--metrics runs: warm-up steps left out")
    ap.add_argument("--out-dir", default=str(DOCS))
    args = ap.parse_args(argv)
    fsdp = None if args.fsdp_json == "none" else Path(args.fsdp_json) if args.fsdp_json else newest("*-fsdp.json")
    runs = measured_runs(fsdp, [Path(p) for p in args.metrics], args.layers, args.skip_steps)
    if not runs:
        raise SystemExit("nothing to render: give --fsdp-json or --metrics")
    render(runs, Path(args.out_dir))


if __name__ == "__main__":
    main()
