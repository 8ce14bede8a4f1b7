"""End-to-end training throughput beside the paper's anchor (213B tokens/day on 64 H100).

The paper (PAPER.md "End to end"): the 7B MoE (sonic_7b preset: 40 layers, E 128, K 8, n 256)
trained with FSDP-2 does 213B tokens/day on 64 H100s, 3.33B per GPU per day; ScatterMoE 225B
on 96. MFU uses our FLOPs/token formula (sonic.models.training_flops) for every row, the
paper's included (its implied MFU): causal attention (the headline, `mfu_causal`) and full
attention (`mfu`) beside it; files written before the trainer logged `mfu_causal` get it from
`mfu` by the ratio of the two FLOPs counts.

  python -m scripts.repro.e2e_throughput                                  # render the committed results
  python -m scripts.repro.e2e_throughput --metrics runs/sonic_7b/metrics.jsonl   # a real run
  python -m scripts.repro.e2e_throughput --run [--layers 40] [--backends triton,grouped_mm]   # GPU

--run trains the full 40-layer sonic_7b with the real trainer (`torchrun` over every visible GPU,
FSDP-2, 4 x 4096 tokens per GPU as the paper's recipe) on the offline BPE text (`data=local_bpe`)
for --steps steps per backend (grouped_mm, our torch._grouped_mm expert backend, for --grouped-mm-steps: it is a
backend of ours, not a peer), and writes
bench/results/<date>-<N>x<gpu>-e2e-40L.json: one record per backend with its steady-state
tokens/s/GPU, B tokens/GPU/day, both MFUs, peak memory and every layer's max/mean expert load at the
last logged step (routing health where the speed was measured), then renders.

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
from scripts.repro.common import (DOCS, REPO, RESULTS, RUNS, fmt, load_json, md_table, newest, pyplot, python,
                                  read_jsonl, rel, run, save_figure, write_text)

PAPER_LAYERS = 40  # configs/model/sonic_7b.yaml, the lm-engine recipe PAPER.md points to
SEQ_LEN = 4096
SLURM_64 = "sbatch --nodes 8 --gpus-per-node 8 scripts/slurm/train.sbatch experiment=sonic_7b"


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'mb8=train.micro_batch_size=8,parallel.x=y' -> ('mb8', ['train.micro_batch_size=8', 'parallel.x=y'])."""
    name, sep, overrides = text.partition("=")
    if not sep or not name or not overrides:
        raise SystemExit(f"--variant {text!r}: write NAME=OVERRIDE[,OVERRIDE...], e.g. mb8=train.micro_batch_size=8")
    return name, overrides.split(",")


def flops_per_token(num_layers: int, causal: bool = False) -> float:
    from sonic.models import flops_per_token as fpt  # noqa: PLC0415 - keeps --help light
    from sonic.models.presets import load_preset  # noqa: PLC0415

    return fpt(load_preset("sonic_7b", num_layers=num_layers), SEQ_LEN, causal)


def mfu_causal(run: dict) -> float | None:
    """The run's causal-attention MFU: logged by the trainer, or derived from its full-attention `mfu`."""
    if run.get("mfu_causal") is not None:
        return run["mfu_causal"]
    if run.get("mfu") is None:
        return None
    return run["mfu"] * flops_per_token(run["layers"], causal=True) / flops_per_token(run["layers"])


def pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


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
    keys = ("tokens_per_s_per_gpu", "tokens_per_s", "btokens_per_day", "mfu_causal", "mfu", "mem_peak_gib")
    out = {k: sum(r[k] for r in kept) / len(kept) for k in keys if all(k in r for r in kept)}
    out["steps_averaged"] = f"{kept[0]['step']}-{kept[-1]['step']}"
    return out


def measured_runs(jsons: list[Path], metrics: list[Path], layers: int, skip: int) -> list[dict]:
    runs = []
    for path in jsons:
        payload = load_json(path)
        worst = {rec["run"]: max(rec["max_load_over_mean"]) for rec in payload.get("records", [])
                 if rec.get("run") and rec["max_load_over_mean"]}
        commits = {rec["run"]: rec.get("commit") for rec in payload.get("records", []) if rec.get("run")}
        for name, r in payload["runs"].items():
            m = re.search(r"model\.num_layers=(\d+)", r["command"])
            runs.append({"name": name, "layers": int(m.group(1)) if m else layers, "device": short(payload["device"]),
                         "source": path, "command": r["command"], "commit": commits.get(name), **r["steady_state"],
                         **({"worst_load": f"{worst[name]:.2f}"} if name in worst else {})})
    for path in metrics:
        runs.append({"name": path.parent.name, "layers": layers, "device": "GPU", "source": path,
                     "command": "", **steady(read_jsonl(path), skip)})
    return runs


TRAIN_ARGS = ["experiment=sonic_7b", f"train.seq_len={SEQ_LEN}", "train.micro_batch_size=4", "train.log_every=5",
              "train.eval_every=0", "train.save_every=0", "train.progress=false", "train.resume=none"]


def run_training(layers: list[int], backends: list[str], steps: int, grouped_mm_steps: int, nproc: int, skip: int,
                 data: str, commit: str, timeout: float | None, variants: dict[str, list[str]],
                 variant_steps: int, runs_dir: Path = RUNS) -> Path:
    """Train each (layers, backend) with the real trainer on this machine's GPUs; one result JSON for all.

    grouped_mm (our torch._grouped_mm expert backend) runs `grouped_mm_steps` steps: it holds ~10x the
    activation memory and is only timed. Each variant (name -> overrides) runs the first
    backend for `variant_steps` steps with its overrides: the levers measured in the same job. A
    run past `timeout` seconds is killed and keeps what it logged."""
    import torch  # noqa: PLC0415

    launcher = [python()] if nproc == 1 else [python(), "-m", "torch.distributed.run", "--standalone",
                                              f"--nproc-per-node={nproc}"]
    commands = {}
    jobs = [(backend, "", []) for backend in backends] + [(backends[0], name, o) for name, o in variants.items()]
    for n_layers in layers:
        for backend, variant, overrides in jobs:
            run_dir = runs_dir / "e2e" / f"{backend}{'_' + variant if variant else ''}_{n_layers}L"
            shutil.rmtree(run_dir, ignore_errors=True)
            n_steps = variant_steps if variant else grouped_mm_steps if backend == "grouped_mm" else steps
            args = [*TRAIN_ARGS, f"data={data}", f"model.num_layers={n_layers}", f"model.moe.kernel_backend={backend}",
                    f"train.steps={n_steps}", f"train.run_dir={rel(run_dir)}", *overrides]
            run([*launcher, "train.py", *args], timeout=timeout)
            if (run_dir / "metrics.jsonl").is_file():
                commands[run_dir] = " ".join(["python" if nproc == 1 else f"torchrun --nproc-per-node {nproc}",
                                              "train.py", *args])
    device = torch.cuda.get_device_name()
    payload = e2e_payload(commands, f"{nproc}x {device}, torch {torch.__version__}", skip)
    payload["records"] = e2e_records(commands, nproc, short(device), skip, commit)
    gpu = short(payload["device"]).lower().replace(" ", "")
    tag = "-".join(sorted({f"{n}L" for n in layers}))
    path = RESULTS / f"{payload['date']}-{nproc}x{gpu}-e2e-{tag}.json"
    write_text(path, json.dumps(payload, indent=1))
    return path


def _arg(command: str, key: str) -> int | None:
    """The last `key=N` override of a command (Hydra applies the last one), or None."""
    found = re.findall(rf"(?:^|\s){re.escape(key)}=(\d+)", command)
    return int(found[-1]) if found else None


def e2e_records(commands: dict[Path, str], nproc: int, gpu: str, skip: int, commit: str) -> list[dict]:
    """One record per run: steady-state speed over the steps after `skip`, every layer's max/mean
    expert load at the last logged step, and the worst layer's at every logged step."""
    records = []
    for run_dir, command in commands.items():
        rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
        state, last = steady(rows, skip), rows[-1]
        layers = int(re.search(r"model\.num_layers=(\d+)", command).group(1))
        loads = [last[f"expert_load_max/{i}"] for i in range(layers) if f"expert_load_max/{i}" in last]
        records.append({"layers": layers, "num_gpus": nproc, "gpu": gpu, "run": Path(run_dir).name,
                        "backend": re.search(r"kernel_backend=(\w+)", command).group(1),
                        "tokens_per_s_per_gpu": state["tokens_per_s_per_gpu"],
                        "btokens_per_gpu_day": per_gpu_day(state["tokens_per_s_per_gpu"]),
                        "mfu_causal": state.get("mfu_causal"), "mfu": state.get("mfu"),
                        "micro_batch_size": _arg(command, "train.micro_batch_size"),
                        "seq_len": _arg(command, "train.seq_len"), "peak_mem_gib": state.get("mem_peak_gib"),
                        # the caching allocator at the end: held memory, and its retries (each a device sync)
                        "reserved_gib": last.get("mem_reserved_gib"), "alloc_retries": last.get("alloc_retries"),
                        "max_load_over_mean": loads, "steps": last["step"], "steps_averaged": state["steps_averaged"],
                        # routing health over the whole run, not only at its end: the worst layer at every log step
                        "max_load_over_mean_by_step": {r["step"]: r["expert_load_max_worst"] for r in rows
                                                       if "expert_load_max_worst" in r},
                        "loss_first_last": [rows[0]["loss"], last["loss"]], "commit": commit, "command": command})
    return records


def e2e_payload(commands: dict[Path, str], device: str, skip: int) -> dict:
    """The result JSON of --run from its runs' metrics.jsonl: steady state and every logged window."""
    runs = {}
    for run_dir, command in commands.items():
        rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
        runs[Path(run_dir).name] = {"command": command, "steady_state": steady(rows, skip), "windows_of_5_steps": rows}
    return {"what": "training throughput of the paper's 7B MoE with the real trainer, one process per GPU: "
                    "scripts/repro/e2e_throughput.py --run",
            "date": datetime.date.today().isoformat(), "device": device, "runs": runs}


def render(runs: list[dict], out_dir: Path, peak_name: str = "H100") -> str:
    fpt_paper = flops_per_token(PAPER_LAYERS)
    h100 = peak(peak_name)
    sonic = paper.E2E["sonicmoe"]
    paper_tps = sonic["btokens_per_gpu_day"] * 1e9 / 86400
    paper_mfu = paper_tps * fpt_paper / h100
    paper_mfu_causal = paper_tps * flops_per_token(PAPER_LAYERS, causal=True) / h100
    scatter_gpu_day = paper.E2E["scattermoe"]["btokens_per_day"] / paper.E2E["scattermoe"]["gpus"]
    table = [["paper: SonicMoE, 64 H100 (PAPER.md)", PAPER_LAYERS, fmt(paper_tps / 1e3, 1),
              f"{sonic['btokens_per_gpu_day']:.2f}", f"{sonic['btokens_per_day']} (64 GPUs)",
              f"{100 * paper_mfu_causal:.1f}% (implied)", f"{100 * paper_mfu:.1f}% (implied)", "–", "–"],
             ["paper: ScatterMoE, 96 H100 (PAPER.md)", PAPER_LAYERS, "–", f"{scatter_gpu_day:.2f}",
              f"{paper.E2E['scattermoe']['btokens_per_day']} (96 GPUs)", "–", "–", "–", "–"]]
    for r in runs:
        gpus = round(r["tokens_per_s"] / r["tokens_per_s_per_gpu"]) if r.get("tokens_per_s") else "?"
        est = at_40_layers(r)
        table.append([f"Sonic {r['name']}, {gpus}× {r['device']}", r["layers"],
                      fmt(r["tokens_per_s_per_gpu"] / 1e3, 1), f"{per_gpu_day(r['tokens_per_s_per_gpu']):.2f}",
                      f"{r['btokens_per_day']:.1f} ({gpus} GPUs)", pct(mfu_causal(r)), pct(r.get("mfu")),
                      f"{per_gpu_day(est):.2f}" if est else "–", fmt(r.get("mem_peak_gib"), 1)])
    head_share = 1 - 4 * (fpt_paper - flops_per_token(4)) / (PAPER_LAYERS - 4) / flops_per_token(4)
    sources = sorted({rel(r["source"]) for r in runs})
    lines = ["# End-to-end training throughput (paper abstract: 213B tokens/day on 64 H100)", "",
             "Measured rows are steady-state means (warm-up window excluded) from: " +
             ", ".join(f"`{s}`" for s in sources) + ". The paper's rows are H100, 40 layers; ours are the 7B "
             "model cut to the layers in the row, on the GPUs it names (the H200 has the same dense bf16 peak as "
             f"the H100 SXM, {peak('H200') / 1e12:.0f} TFLOP/s, and more memory bandwidth: a guide, not a like-for-like "
             "comparison). MFU uses our FLOPs/token (6 × active matmul params + attention, "
             "sonic.models.training_flops; docs/performance.md works it out): MFU counts the attention a causal "
             f"mask needs, {flops_per_token(PAPER_LAYERS, causal=True) / 1e9:.2f} GFLOP/token for 40 layers at "
             f"seq 4096; 'MFU, full attention' counts the whole S x S scores, {fpt_paper / 1e9:.2f} GFLOP/token "
             f"({flops_per_token(4) / 1e9:.2f} for 4 layers, of which {100 * head_share:.0f}% is embedding/LM head "
             "and other non-layer work). Files written before the trainer logged `mfu_causal` get it from `mfu` by "
             "the ratio of the two counts. 'Paper implied MFU' applies the formula to the paper's 3.33B/GPU/day. "
             "'40 layers at this MFU' is the measured MFU carried to the 40-layer FLOPs/token: an estimate.", "",
             md_table(table, ["run", "layers", "k tokens/s/GPU", "B tokens/GPU/day", "B tokens/day (job)", "MFU",
                              "MFU, full attention", "est. B tokens/GPU/day, 40 layers at this MFU",
                              "peak mem GiB"]), "",
             "Commands of the measured runs, with the commit each measured:", ""]
    lines += [f"- {r['name']}: `{r['command']}`; {commit_words(r)}" for r in runs if r["command"]]
    lines += lever_sections(runs)
    lines += ["", "The paper's configuration (64 GPUs = 8 nodes × 8; FSDP-2 over all 64, or HSDP with "
              "`parallel.dp_replicate=8`), not run yet:", "", f"```bash\n{SLURM_64}\n```", "",
              "Then `python -m scripts.repro.e2e_throughput --metrics runs/sonic_7b/metrics.jsonl` puts its "
              "steady state in this table (btokens_per_day in metrics.jsonl is for the whole job).", "",
              "![throughput](e2e_throughput.png)"]
    text = "\n".join(lines)
    write_text(out_dir / "e2e_throughput.md", text)
    plot(runs, paper_tps, paper_mfu_causal, scatter_gpu_day, out_dir / "e2e_throughput.png")
    return text


def commit_words(run: dict) -> str:
    """Which commit a run's numbers come from (scripts.claims.provenance: the recorded one, else the one that
    added the result file)."""
    from scripts.claims import ClaimError, provenance  # noqa: PLC0415

    try:
        return provenance(REPO, rel(run["source"]), run.get("commit"))
    except ClaimError as err:
        return str(err)


def lever_sections(runs: list[dict]) -> list[str]:
    """Markdown: each fast path's effect on one GPU (the newest *-levers.json, sonic_7b cut to a few
    layers) and on the 40-layer model (its --run records: other backends, variants), as ratios on one GPU kind."""
    lines = []
    lever_files = sorted(RESULTS.glob("*-levers.json"))
    if lever_files:
        src = lever_files[-1]
        payload = load_json(src)
        rows = [r for r in payload["rows"] if "tokens_per_s" in r]
        base = rows[0]["tokens_per_s"]
        compiled = next((r["tokens_per_s"] for r in rows if r["lever"] == "+ compile"), None)
        shape = {"layers": payload["layers"]}
        table = [[r["lever"], fmt(r["tokens_per_s"] / 1e3, 1), f"{r['tokens_per_s'] / base:.2f}",
                  f"{r['tokens_per_s'] / compiled:.2f}" if compiled and not r["lever"].startswith("+ ")
                  and r["lever"] != "before" else "–",
                  pct(mfu_causal({**shape, **r})), pct(r.get("mfu")), fmt(r.get("peak_mem_gib"), 1)] for r in rows]
        lines += ["", f"## Levers, one at a time ({payload['model']} cut to {payload['layers']} layers, "
                  f"{payload['batch'][0]}x{payload['batch'][1]} tokens, {payload['device']})", "",
                  f"`{payload['command']}` → `{rel(src)}`; {commit_words({'source': src})}. Cumulative down to "
                  "`+ compile` (the measured ladder: its last `× before` is the whole gain); the rows below it swap "
                  "one piece of that rung (another loss or attention backend, document-masked batches) in the same "
                  "process, so their ratio is to `+ compile`. `doc sdpa dense mask` is a path the default never "
                  "takes (`model.attention_backend=auto` picks FlexAttention for document masks on GPUs).", "",
                  md_table(table, ["lever", "k tokens/s", "× before", "× + compile", "MFU", "MFU, full attention",
                                   "peak GiB"])]
    forty = [r for r in runs if r["layers"] == PAPER_LAYERS]
    if forty:
        base = next((r for r in forty if r["name"] == "triton_40L"), forty[0])["tokens_per_s_per_gpu"]
        table = [[r["name"], r["device"], fmt(r["tokens_per_s_per_gpu"] / 1e3, 1), f"{r['tokens_per_s_per_gpu'] / base:.2f}",
                  f"{per_gpu_day(r['tokens_per_s_per_gpu']):.2f}", pct(mfu_causal(r)), pct(r.get("mfu")),
                  fmt(r.get("mem_peak_gib"), 1), r.get("worst_load", "–")] for r in forty]
        lines += ["", "## The 40-layer model: other backends and the levers that need the full model", "",
                  "Same job, same GPUs, the real trainer (`--run`). `grouped_mm` is our own torch._grouped_mm "
                  "expert backend in our model (not torchtitan, not a peer); `noreshard` keeps each block's "
                  "gathered bf16 weights from forward to backward (parallel.reshard_after_forward=false: no second "
                  "all-gather); `mb8` doubles the micro-batch to 8 x 4096 (the paper's recipe is 4; its global "
                  "batch, 1M tokens on 64 GPUs, is still 16x ours). Worst load: the largest max/mean expert load "
                  "over the 40 layers at the last logged step.", "",
                  md_table(table, ["run", "GPU", "k tokens/s/GPU", "× triton_40L", "B tokens/GPU/day", "MFU",
                                   "MFU, full attention", "peak GiB", "worst load"])]
    return lines


def plot(runs, paper_tps, paper_mfu, scatter_gpu_day, path: Path) -> None:
    plt = pyplot()
    bars = [("paper SonicMoE, 64×H100, 40 L", per_gpu_day(paper_tps), "k", ""),
            ("paper ScatterMoE, 96×H100, 40 L", scatter_gpu_day, "grey", "")]
    for r in runs:
        bars.append((f"Sonic {r['name']}, {r['layers']} L, measured", per_gpu_day(r["tokens_per_s_per_gpu"]), "C0", ""))
        if at_40_layers(r):
            bars.append((f"Sonic {r['name']}, 40 L at its MFU (est.)", per_gpu_day(at_40_layers(r)), "white", "//"))
    mfus = [("paper SonicMoE (implied)", paper_mfu, "k")] + [
        (f"Sonic {r['name']}, {r['layers']} L", mfu_causal(r), "C0") for r in runs if mfu_causal(r) is not None]
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
    b.set_xlabel(f"MFU, causal attention, % (our FLOPs/token formula; {peak('H100') / 1e12:.0f} TFLOP/s dense bf16 peak)")
    for ax in (a, b):
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlim(0, ax.get_xlim()[1] * 1.1)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", nargs="*", default=None,
                    help="result files (default: the newest bench/results/*-fsdp.json and *-e2e.json)")
    ap.add_argument("--run", action="store_true",
                    help="(GPU) train first, write bench/results/<date>-<N>x<gpu>-e2e-<layers>L.json")
    ap.add_argument("--backends", default="triton,grouped_mm", help="--run: comma list of model.moe.kernel_backend")
    ap.add_argument("--steps", type=int, default=200, help="--run: training steps per run")
    ap.add_argument("--grouped-mm-steps", type=int, default=60,
                    help="--run: steps of the grouped_mm backend (timed only: it holds ~10x the activations)")
    ap.add_argument("--nproc", type=int, default=0, help="--run: GPUs (torchrun) per run; 0 = all visible")
    ap.add_argument("--data", default="local_bpe", help="--run: the data= choice (offline BPE text by default)")
    ap.add_argument("--commit", default="", help="--run: the commit measured, for the record")
    ap.add_argument("--run-timeout", type=float, default=None, help="--run: seconds before a run is killed")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDE[,OVERRIDE]",
                    help="--run: also run the first backend with these Hydra overrides (repeatable)")
    ap.add_argument("--variant-steps", type=int, default=None,
                    help="--run: steps of each variant (default: --steps, so that it averages the base run's steps)")
    ap.add_argument("--metrics", nargs="*", default=[], help="metrics.jsonl of sonic_7b training runs")
    ap.add_argument("--layers", default=str(PAPER_LAYERS), help="--metrics: model.num_layers; --run: comma list")
    ap.add_argument("--skip-steps", type=int, default=20, help="warm-up (compile) steps left out of the means")
    ap.add_argument("--out-dir", default=str(DOCS))
    ap.add_argument("--runs-dir", default=str(RUNS), help="--run: the run directories go to <runs-dir>/e2e/")
    args = ap.parse_args(argv)
    layers = [int(v) for v in args.layers.split(",")]
    committed = [newest(p) for p in ("*-fsdp.json", "*-e2e.json") if sorted(RESULTS.glob(p))]
    committed += sorted(RESULTS.glob("*-e2e-40L*.json"))  # the 40-layer runs and their levers
    if args.run:
        import torch  # noqa: PLC0415

        from bench.common import git_commit  # noqa: PLC0415 - imports torch, as --run does

        nproc = args.nproc or torch.cuda.device_count()
        fresh = run_training(layers, args.backends.split(","), args.steps, args.grouped_mm_steps, nproc, args.skip_steps,
                             args.data, args.commit or git_commit(), args.run_timeout,
                             dict(parse_variant(v) for v in args.variant),
                             args.steps if args.variant_steps is None else args.variant_steps, Path(args.runs_dir))
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
