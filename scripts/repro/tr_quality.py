"""Table 3a: token rounding keeps model quality (NR-f vs top-K vs token drop), beside the paper.

The three arms differ only in the training-time routing; evaluation always routes top-K.
  topk   token choice                         routing=topk
  nr_f   token rounding, nearest (NR-f)       routing=token_rounding
  drop   token rounding, always down          routing=token_rounding model.moe.routing.rounding_mode=down

Full run (the paper's 0.5B 8/64, 20B tokens, 8 GPUs per arm) as one Slurm sweep, then collect:
  python train.py -m hydra/launcher=slurm hydra.launcher.tasks_per_node=8 \\
      experiment=repro_tr_0p5b_nrf,repro_tr_0p5b_topk,repro_tr_0p5b_drop
  python -m scripts.repro.tr_quality                 # reads runs/tr_0p5b_*/metrics.jsonl

CPU proxy (NOT the paper's setup: configs/experiment/repro_tr_proxy.yaml, ~10 CPU-minutes for
all three arms): runs the arms one after another, copies their metrics.jsonl under
docs/repro/tr_proxy/, measures on the final weights how many rows each arm routes in training
mode (routed rows / top-K rows), and renders.
  python -m scripts.repro.tr_quality --proxy [--steps 300]
  python -m scripts.repro.tr_quality --proxy --collect-only   # re-render the committed proxy
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

from scripts.repro import paper
from scripts.repro.common import DOCS, REPO, md_table, pyplot, python, read_jsonl, rel, run, save_figure, write_text

ARMS = {  # arm: (label, paper's column in TABLE_3A, train.py overrides)
    "topk": ("top-K", "topk", ["routing=topk"]),
    "nr_f": ("TR (NR-f)", "nr_f", ["routing=token_rounding"]),
    "drop": ("token drop (TR down)", "drop", ["routing=token_rounding", "model.moe.routing.rounding_mode=down"]),
}
FULL_DIRS = {"topk": "runs/tr_0p5b_topk_nearest", "nr_f": "runs/tr_0p5b_token_rounding_nearest",
             "drop": "runs/tr_0p5b_token_rounding_down"}
PROXY_DIRS = {"topk": "runs/repro_tr_proxy_topk_nearest", "nr_f": "runs/repro_tr_proxy_token_rounding_nearest",
              "drop": "runs/repro_tr_proxy_token_rounding_down"}
PROXY_OUT = DOCS / "tr_proxy"


def summarize(rows: list[dict], last: int = 3) -> dict:
    """Final and best validation loss, mean train loss of the last `last` logged steps."""
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if not val:
        raise ValueError("no val_loss in metrics.jsonl (train.eval_every=0?)")
    train = [r["loss"] for r in rows if "loss" in r][-last:]
    acc = [r[k] for r in rows for k in r if k == "lm_eval/sonic_paper/acc"]
    return {"steps": rows[-1]["step"], "val_final": val[-1][1], "val_best": min(v for _, v in val),
            "train_final": sum(train) / len(train), "acc": acc[-1] if acc else None,
            "curve": val, "train_curve": [(r["step"], r["loss"]) for r in rows if "loss" in r]}


def routed_fraction(run_dir: Path, batches: int = 8) -> float:
    """Rows routed in training mode / top-K rows, on the run's final weights and training batches."""
    import torch
    from omegaconf import OmegaConf

    from sonic.data import build_loaders, build_tokenizer
    from sonic.models.loading import load_model
    from sonic.routing.router import Router
    from sonic.train.config import to_config

    loaded = load_model(run_dir)
    cfg = to_config(OmegaConf.load(loaded.path / "config.yaml"))
    tokenizer = build_tokenizer(cfg.data)
    train_loader, _ = build_loaders(cfg.data, tokenizer=tokenizer, seq_len=cfg.train.seq_len,
                                    micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed)
    totals = torch.zeros(2, dtype=torch.float64)

    def hook(_module, _inputs, out):
        totals[0] += out.counts_E.sum().item()
        totals[1] += out.topk_counts_E.sum().item()

    model = loaded.model.train()  # training-mode routing is what the arms differ in
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, Router)]
    with torch.no_grad():
        for _ in range(batches):
            model(next(train_loader)["input_ids"])
    for h in handles:
        h.remove()
    return (totals[0] / totals[1]).item()


def render(summaries: dict[str, dict], out_dir: Path, name: str, title: str, note: str,
           routed: dict[str, float] | None = None) -> str:
    routed = routed or {}
    ref = summaries.get("topk")
    p = paper.TABLE_3A["0.5B 8/64"]
    rows = []
    for arm, s in summaries.items():
        label, col, _ = ARMS[arm]
        dv = "–" if ref is None or arm == "topk" else f"{s['val_final'] - ref['val_final']:+.4f}"
        rel_ppl = "–" if ref is None else f"{100 * (math.exp(s['val_final'] - ref['val_final']) - 1):+.2f}%"
        paper_rel = f"{100 * (p[col][1] / p['topk'][1] - 1):+.2f}%"
        rows.append([label, s["steps"], f"{s['train_final']:.4f}", f"{s['val_final']:.4f}", f"{s['val_best']:.4f}",
                     f"{math.exp(s['val_final']):.3f}", dv, rel_ppl,
                     f"{routed[arm]:.3f}" if arm in routed else "–",
                     "–" if s["acc"] is None else f"{100 * s['acc']:.1f}",
                     f"{p[col][0]:.2f} / {p[col][1]:.2f} / {p[col][2]:.1f}", paper_rel])
    lines = [f"# {title}", "", note, "",
             md_table(rows, ["arm", "steps", "train loss (last 3 logs)", "val loss (final)", "val loss (best)",
                             "val PPL", "Δ val loss vs top-K", "val PPL vs top-K", "routed rows ÷ top-K rows",
                             "avg acc %", "paper 0.5B 8/64: train PPL / val PPL / acc (H100)",
                             "paper val PPL vs top-K"]), "",
             "Paper: PAPER.md Table 3 (0.5B 8/64, 20B tokens of FineWeb-Edu). Validation always routes top-K "
             "(token rounding is a training-time change). Per-step validation losses are in the plot.", "",
             f"![validation loss]({name}.png)"]
    text = "\n".join(lines)
    write_text(out_dir / f"{name}.md", text)
    plot(summaries, out_dir / f"{name}.png", title)
    return text


def plot(summaries: dict[str, dict], path: Path, title: str) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for j, (arm, s) in enumerate(summaries.items()):
        steps, vals = zip(*s["curve"])
        a.plot(steps, vals, "o-", ms=3, color=f"C{j}", label=f"{ARMS[arm][0]} val")
        tsteps, tvals = zip(*s["train_curve"])
        a.plot(tsteps, tvals, ":", color=f"C{j}", alpha=0.6, label=f"{ARMS[arm][0]} train")
        half = [(st, v) for st, v in s["curve"] if st >= steps[-1] / 2]
        b.plot(*zip(*half), "o-", ms=4, color=f"C{j}", label=ARMS[arm][0])
    a.set(xlabel="step", ylabel="loss", title="loss (val: top-K routing)")
    a.set_ylim(top=min(a.get_ylim()[1], 2 * max(s["val_final"] for s in summaries.values())))
    b.set(xlabel="step", ylabel="validation loss", title="validation loss, second half")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def run_proxy(steps: int | None, extra: list[str]) -> None:
    """Train the three proxy arms one after another, each from scratch, and keep their metrics."""
    for arm, (_, _, overrides) in ARMS.items():
        run_dir = REPO / PROXY_DIRS[arm]
        if run_dir.exists():
            shutil.rmtree(run_dir)  # metrics.jsonl appends: a fresh run needs a fresh directory
        cmd = [python(), "train.py", "experiment=repro_tr_proxy", *overrides, "train.resume=none"]
        if steps:
            cmd += [f"train.steps={steps}", f"train.save_every={steps}", f"optim.warmup_steps={max(1, steps // 10)}"]
        run(cmd + extra)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--proxy", action="store_true", help="the CPU proxy (configs/experiment/repro_tr_proxy.yaml)")
    ap.add_argument("--collect-only", action="store_true", help="--proxy: render the committed metrics, train nothing")
    ap.add_argument("--steps", type=int, default=None, help="--proxy: override train.steps")
    ap.add_argument("--runs", nargs=3, metavar=("TOPK", "NR_F", "DROP"), default=None,
                    help="run directories (or metrics.jsonl files) of the three arms")
    ap.add_argument("--out-dir", default=str(DOCS))
    ap.add_argument("extra", nargs="*", help="after --: further train.py overrides for the proxy runs")
    args = ap.parse_args(argv)
    out_dir = Path(args.out_dir)

    routed: dict[str, float] = {}
    if args.proxy:
        kept = PROXY_OUT if out_dir == DOCS else out_dir / "tr_proxy"
        if not args.collect_only:
            run_proxy(args.steps, args.extra)
            kept.mkdir(parents=True, exist_ok=True)
            for arm in ARMS:
                shutil.copy(REPO / PROXY_DIRS[arm] / "metrics.jsonl", kept / f"{arm}.metrics.jsonl")
                routed[arm] = routed_fraction(REPO / PROXY_DIRS[arm])
            (kept / "routed_rows.json").write_text(json.dumps(
                {"what": "rows routed in training mode / top-K rows, final weights, 8 training batches "
                         "(scripts/repro/tr_quality.py routed_fraction)", **routed}, indent=1) + "\n")
        elif (kept / "routed_rows.json").exists():
            routed = {k: v for k, v in json.loads((kept / "routed_rows.json").read_text()).items() if k in ARMS}
        files = {arm: kept / f"{arm}.metrics.jsonl" for arm in ARMS}
        title = "CPU PROXY of Table 3a (tiny model, embedded corpus; not the paper's setup)"
        note = ("**CPU proxy, not the paper's setup**: configs/experiment/repro_tr_proxy.yaml, the tiny 4-layer d-128 "
                "model with E 16, K 2 (the 0.5B model's K/E = 1/8), n 64, tile 64, 2048 tokens per micro-batch, so "
                "T·K/E = 256 rows per expert = 4 tiles (the paper needs ≥ 2; its 0.5B run has 64), on the embedded "
                "corpus with a byte tokenizer, one seed, fp32 on CPU. Metrics: " +
                ", ".join(f"`{rel(f)}`" for f in files.values()) + "; the routed-row fractions: "
                f"`{rel(kept / 'routed_rows.json')}`. Command: `python -m scripts.repro.tr_quality --proxy`.")
        name = "tr_proxy"
    else:
        dirs = dict(zip(ARMS, args.runs)) if args.runs else FULL_DIRS
        files = {arm: Path(d) if str(d).endswith(".jsonl") else Path(d) / "metrics.jsonl" for arm, d in dirs.items()}
        missing = [rel(f) for f in files.values() if not f.exists()]
        if missing:
            raise SystemExit("not run yet: " + ", ".join(missing) + " (see this script's docstring for the sweep)")
        title = "Table 3a: token rounding quality, 0.5B 8/64"
        note = "Metrics: " + ", ".join(f"`{rel(f)}`" for f in files.values()) + "."
        name = "tr_quality"
    summaries = {arm: summarize(read_jsonl(f)) for arm, f in files.items()}
    render(summaries, out_dir, name, title, note, routed)


if __name__ == "__main__":
    main()
