"""End-to-end training throughput beside the paper's anchor (213B tokens/day on 64 H100).

The paper (PAPER.md "End to end"): the 7B MoE (sonic_7b preset: 40 layers, E 128, K 8, n 256)
trained with FSDP-2 does 213B tokens/day on 64 H100s, 3.33B per GPU per day; ScatterMoE 225B
on 96. What we can measure on the lent GPUs is the same model cut to a few layers (40 layers
with AdamW need ~108 GB of weights and optimizer state: more than one GPU holds). Tokens per
GPU per day of a cut model are not comparable to 40 layers, so the table also gives MFU (our
FLOPs/token formula, sonic.models.flops_per_token) and, derived from it, what the 40-layer
model would do at the measured MFU; a 4-layer model spends about half its FLOPs in the
100k-vocabulary head, so that is a rough estimate, not a measurement.

  python -m scripts.repro.e2e_throughput                                  # newest *-fsdp.json, *-e2e.json
  python -m scripts.repro.e2e_throughput --metrics runs/sonic_7b/metrics.jsonl   # a real run
  python -m scripts.repro.e2e_throughput --run --layers 4,8 --backends cute,triton [--nproc 2]   # GPU

--run trains the 7B model cut to each --layers count with each kernel backend for --steps steps
(embedded corpus, 4 x 4096 tokens per GPU as the paper's recipe), then writes
bench/results/<date>-<gpu>-e2e.json (steady state and 5-step windows of every run) and renders.

The 64-GPU run (8 nodes x 8 H100):
  sbatch --nodes 8 --gpus-per-node 8 scripts/slurm/train.sbatch experiment=sonic_7b
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
from pathlib import Path

from scripts.repro import paper
from scripts.repro.common import (DOCS, REPO, RESULTS, fmt, load_json, md_table, newest, pyplot, python,
                                  read_jsonl, rel, run, save_figure, write_text)

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


def measured_runs(jsons: list[Path], metrics: list[Path], layers: int, skip: int) -> list[dict]:
    runs = []
    for path in jsons:
        payload = load_json(path)
        for name, r in payload["runs"].items():
            m = re.search(r"model\.num_layers=(\d+)", r["command"])
            runs.append({"name": name, "layers": int(m.group(1)) if m else layers, "device": short(payload["device"]),
                         "source": path, "command": r["command"], **r["steady_state"]})
    for path in metrics:
        runs.append({"name": path.parent.name, "layers": layers, "device": "GPU", "source": path,
                     "command": "", **steady(read_jsonl(path), skip)})
    return runs


TRAIN_ARGS = ["model=sonic_7b", f"train.seq_len={SEQ_LEN}", "train.micro_batch_size=4", "train.log_every=5",
              "train.eval_every=0", "train.save_every=0", "train.progress=false", "train.resume=none"]


def run_training(layers: list[int], backends: list[str], steps: int, nproc: int, skip: int) -> Path:
    """Train each (layers, backend) for `steps` steps on this machine's GPUs; one result JSON for all."""
    import torch  # noqa: PLC0415

    launcher = [python()] if nproc == 1 else [python(), "-m", "torch.distributed.run", "--standalone",
                                              f"--nproc-per-node={nproc}"]
    commands = {}
    for n_layers in layers:
        for backend in backends:
            run_dir = REPO / "runs" / "e2e" / f"{backend}_{n_layers}L"
            shutil.rmtree(run_dir, ignore_errors=True)
            args = [*TRAIN_ARGS, f"model.num_layers={n_layers}", f"model.moe.kernel_backend={backend}",
                    f"train.steps={steps}", f"train.run_dir={rel(run_dir)}"]
            run([*launcher, "train.py", *args])
            commands[run_dir] = " ".join(["python" if nproc == 1 else f"torchrun --nproc-per-node {nproc}",
                                          "train.py", *args])
    payload = e2e_payload(commands, f"{nproc}x {torch.cuda.get_device_name()}, torch {torch.__version__}", skip)
    gpu = short(payload["device"]).lower().replace(" ", "")
    path = RESULTS / f"{payload['date']}-{f'{nproc}x' if nproc > 1 else ''}{gpu}-e2e.json"
    write_text(path, json.dumps(payload, indent=1))
    return path


def e2e_payload(commands: dict[Path, str], device: str, skip: int) -> dict:
    """The result JSON of --run from its runs' metrics.jsonl: steady state and every logged window."""
    runs = {}
    for run_dir, command in commands.items():
        rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
        runs[Path(run_dir).name] = {"command": command, "steady_state": steady(rows, skip), "windows_of_5_steps": rows}
    return {"what": "training throughput of the paper's 7B MoE cut to a few layers on the embedded corpus (byte "
                    "tokens, the 100k-vocabulary head kept), one process per GPU: scripts/repro/e2e_throughput.py --run",
            "date": datetime.date.today().isoformat(), "device": device, "runs": runs}


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
             ", ".join(f"`{s}`" for s in sources) + ". The paper's rows are H100, 40 layers; ours are the 7B "
             "model cut to the layers in the row, on the GPUs it names (the H200 has the same dense bf16 peak as "
             f"the H100 SXM, {peak('H200') / 1e12:.0f} TFLOP/s, and more memory bandwidth). MFU uses our FLOPs/token (6 × active matmul params + attention, "
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
    ap.add_argument("--json", nargs="*", default=None,
                    help="result files (default: the newest bench/results/*-fsdp.json and *-e2e.json)")
    ap.add_argument("--run", action="store_true", help="(GPU) train first, write bench/results/<date>-<gpu>-e2e.json")
    ap.add_argument("--backends", default="triton", help="--run: comma list of model.moe.kernel_backend")
    ap.add_argument("--steps", type=int, default=40, help="--run: training steps per run")
    ap.add_argument("--nproc", type=int, default=1, help="--run: GPUs (torchrun) per run")
    ap.add_argument("--metrics", nargs="*", default=[], help="metrics.jsonl of sonic_7b training runs")
    ap.add_argument("--layers", default=str(PAPER_LAYERS), help="--metrics: model.num_layers; --run: comma list")
    ap.add_argument("--skip-steps", type=int, default=10, help="--metrics runs: warm-up steps left out")
    ap.add_argument("--out-dir", default=str(DOCS))
    args = ap.parse_args(argv)
    layers = [int(v) for v in args.layers.split(",")]
    committed = [newest(p) for p in ("*-fsdp.json", "*-e2e.json") if sorted(RESULTS.glob(p))]
    if args.run:
        fresh = run_training(layers, args.backends.split(","), args.steps, args.nproc, args.skip_steps)
        jsons = [p for p in committed if p != fresh] + [fresh]
    elif args.json is not None:
        jsons = [Path(p) for p in args.json]
    else:
        jsons = committed
    runs = measured_runs(jsons, [Path(p) for p in args.metrics], layers[0], args.skip_steps)
    if not runs:
        raise SystemExit("nothing to render: give --json or --metrics")
    render(runs, Path(args.out_dir))


if __name__ == "__main__":
    main()
