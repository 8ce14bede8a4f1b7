"""Table 3a: token rounding keeps model quality (NR-f vs top-K vs token drop), beside the paper.

The three arms differ only in the training-time routing; evaluation always routes top-K.
  topk   token choice                         routing=topk
  nr_f   token rounding, nearest (NR-f)       routing=token_rounding
  drop   token rounding, always down          routing=token_rounding model.moe.routing.rounding_mode=down

Full run (the paper's 0.5B 8/64, 20B tokens, 8 GPUs per arm) as one Slurm sweep, then collect:
  python train.py -m hydra/launcher=slurm hydra.launcher.tasks_per_node=8 \\
      experiment=repro_tr_0p5b_nrf,repro_tr_0p5b_topk,repro_tr_0p5b_drop
  python -m scripts.repro.tr_quality                 # reads runs/tr_0p5b_*/metrics.jsonl

CPU proxy (NOT the paper's setup: configs/experiment/repro_tr_proxy.yaml, about 1 CPU-minute
per arm and seed on 2 cores): runs the arms one after another for each seed, copies their
metrics.jsonl under docs/repro/tr_proxy/, measures on the final weights how many rows each arm
routes in training mode (routed rows / top-K rows), and renders. Several seeds give the noise
floor that the arms' differences are judged against (differences are paired by seed).
  python -m scripts.repro.tr_quality --proxy --seeds 0,1,2 [--steps 300]
  python -m scripts.repro.tr_quality --proxy --collect-only   # re-render the committed proxy
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
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


def _mean_sd(xs: list[float]) -> tuple[float, float | None]:
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None)


def _pm(xs: list[float], digits: int = 4, scale: float = 1.0, sign: str = "") -> str:
    m, sd = _mean_sd([scale * x for x in xs])
    return f"{m:{sign}.{digits}f}" + ("" if sd is None else f" ± {sd:.{digits}f}")


T_95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # Student t, 97.5% quantile by df


def _verdicts(summaries: dict[str, list[dict]]) -> list[str]:
    """Per arm, the paired mean difference to top-K in units of its standard error (needs >= 2 seeds)."""
    ref = summaries.get("topk")
    out = []
    for arm, runs in summaries.items():
        if arm == "topk" or ref is None or len(runs) != len(ref) or len(runs) < 2:
            continue
        m, sd = _mean_sd([s["val_final"] - r["val_final"] for s, r in zip(runs, ref)])
        se = sd / math.sqrt(len(runs))
        t = m / se if se > 0 else float("inf") * (1 if m >= 0 else -1)
        crit = T_95.get(len(runs) - 1, 1.96)
        out += [f"- {ARMS[arm][0]} − top-K, final val loss: {m:+.4f}, standard error {se:.4f} over {len(runs)} "
                f"paired seeds: t = {t:+.2f}, {'within' if abs(t) < crit else 'outside'} seed noise "
                f"(two-sided 95%: |t| < {crit})."]
    return out + ([""] if out else [])


def render(summaries: dict[str, list[dict]], out_dir: Path, name: str, title: str, note: str,
           routed: dict[str, list[float]] | None = None) -> str:
    """One row per arm; with several seeds per arm: mean ± sample sd over seeds, and differences to top-K
    paired by seed (same data order and init), which is what the seed noise should be judged by."""
    routed = routed or {}
    ref = summaries.get("topk")
    p = paper.TABLE_3A["0.5B 8/64"]
    rows = []
    for arm, runs in summaries.items():
        label, col, _ = ARMS[arm]
        vals = [s["val_final"] for s in runs]
        if ref is None or arm == "topk" or len(ref) != len(runs):
            dv = rel_ppl = "–"
        else:
            diffs = [s["val_final"] - r["val_final"] for s, r in zip(runs, ref)]
            dv = _pm(diffs, sign="+")
            rel_ppl = _pm([math.exp(d) - 1 for d in diffs], digits=2, scale=100, sign="+") + "%"
        rows.append([label, len(runs), runs[0]["steps"], _pm([s["train_final"] for s in runs]), _pm(vals),
                     " / ".join(f"{v:.4f}" for v in vals) if len(runs) > 1 else "–", dv, rel_ppl,
                     _pm(routed[arm], digits=3) if routed.get(arm) else "–",
                     "–" if runs[0]["acc"] is None else _pm([s["acc"] for s in runs], digits=1, scale=100),
                     f"{p[col][0]:.2f} / {p[col][1]:.2f} / {p[col][2]:.1f}",
                     f"{100 * (p[col][1] / p['topk'][1] - 1):+.2f}%"])
    lines = [f"# {title}", "", note, "",
             md_table(rows, ["arm", "seeds", "steps", "train loss (last 3 logs)", "val loss (final)",
                             "val loss per seed", "Δ val loss vs top-K (paired)", "val PPL vs top-K",
                             "routed rows ÷ top-K rows", "avg acc %",
                             "paper 0.5B 8/64: train PPL / val PPL / acc (H100)", "paper val PPL vs top-K"]), "",
             *_verdicts(summaries),
             "± is the sample standard deviation over seeds. Paper: PAPER.md Table 3 (0.5B 8/64, 20B tokens of "
             "FineWeb-Edu). Validation always routes top-K (token rounding is a training-time change).", "",
             f"![validation loss]({name}.png)"]
    text = "\n".join(lines)
    write_text(out_dir / f"{name}.md", text)
    plot(summaries, out_dir / f"{name}.png", title)
    return text


def plot(summaries: dict[str, list[dict]], path: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    a, b, c = axes
    p = paper.TABLE_3A["0.5B 8/64"]
    ref = summaries.get("topk")
    for j, (arm, runs) in enumerate(summaries.items()):
        label = ARMS[arm][0]
        for i, s in enumerate(runs):
            steps, vals = zip(*s["curve"])
            a.plot(steps, vals, "o-", ms=3, lw=1, color=f"C{j}", alpha=0.8, label=f"{label} val" if i == 0 else None)
            tsteps, tvals = zip(*s["train_curve"])
            a.plot(tsteps, tvals, ":", color=f"C{j}", alpha=0.4, label=f"{label} train" if i == 0 else None)
            half = [(st, v) for st, v in s["curve"] if st >= steps[-1] / 2]
            b.plot(*zip(*half), "o-", ms=3, lw=1, color=f"C{j}", label=label if i == 0 else None)
        if ref is not None and len(ref) == len(runs):
            diffs = [100 * (math.exp(s["val_final"] - r["val_final"]) - 1) for s, r in zip(runs, ref)]
            m, sd = _mean_sd(diffs)
            c.bar(j - 0.2, m, 0.4, yerr=sd or 0, color=f"C{j}", capsize=4, label="this run" if j == 0 else None)
            c.plot([j - 0.2] * len(diffs), diffs, "k.", ms=4)
        col = ARMS[arm][1]
        c.bar(j + 0.2, 100 * (p[col][1] / p["topk"][1] - 1), 0.4, color="none", edgecolor=f"C{j}", hatch="//",
              label="paper 0.5B 8/64 (H100)" if j == 0 else None)
    a.set(xlabel="step", ylabel="loss", title="loss (val routes top-K)")
    finals = [s["val_final"] for runs in summaries.values() for s in runs]
    a.set_ylim(top=min(a.get_ylim()[1], 3 * max(finals)))
    b.set(xlabel="step", ylabel="validation loss", title="validation loss, second half")
    c.axhline(0, color="k", lw=0.8)
    c.set_xticks(range(len(summaries)), [ARMS[arm][0] for arm in summaries], fontsize=8)
    c.set(ylabel="final val PPL vs top-K, %", title="relative to top-K (dots: seeds)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def run_proxy(seeds: list[int], steps: int | None, extra: list[str]) -> dict[tuple[str, int], Path]:
    """Train the three proxy arms for every seed, one after another, each from scratch."""
    dirs = {}
    for seed in seeds:
        for arm, (_, _, overrides) in ARMS.items():
            run_dir = REPO / "runs" / f"repro_tr_proxy_{arm}_s{seed}"
            if run_dir.exists():
                shutil.rmtree(run_dir)  # metrics.jsonl appends: a fresh run needs a fresh directory
            cmd = [python(), "train.py", "experiment=repro_tr_proxy", *overrides, f"train.seed={seed}",
                   f"train.run_dir={rel(run_dir)}", "train.resume=none"]
            if steps:
                cmd += [f"train.steps={steps}", f"train.save_every={steps}",
                        f"optim.warmup_steps={max(1, steps // 10)}"]
            run(cmd + extra)
            dirs[arm, seed] = run_dir
    return dirs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--proxy", action="store_true", help="the CPU proxy (configs/experiment/repro_tr_proxy.yaml)")
    ap.add_argument("--seeds", default="0", help="--proxy: comma list of train.seed values (each runs all arms)")
    ap.add_argument("--collect-only", action="store_true", help="--proxy: render the kept metrics, train nothing")
    ap.add_argument("--steps", type=int, default=None, help="--proxy: override train.steps")
    ap.add_argument("--runs", nargs=3, metavar=("TOPK", "NR_F", "DROP"), default=None,
                    help="run directories (or metrics.jsonl files) of the three arms")
    ap.add_argument("--out-dir", default=str(DOCS))
    ap.add_argument("extra", nargs="*", help="after --: further train.py overrides for the proxy runs")
    args = ap.parse_args(argv)
    out_dir = Path(args.out_dir)

    routed: dict[str, list[float]] = {}
    if args.proxy:
        kept = out_dir / "tr_proxy"
        if not args.collect_only:
            seeds = [int(v) for v in args.seeds.split(",")]
            dirs = run_proxy(seeds, args.steps, args.extra)
            if kept.exists():
                shutil.rmtree(kept)  # the kept metrics are exactly this invocation's runs
            kept.mkdir(parents=True)
            fractions = {}
            for (arm, seed), run_dir in dirs.items():
                shutil.copy(run_dir / "metrics.jsonl", kept / f"{arm}.s{seed}.metrics.jsonl")
                fractions[f"{arm}.s{seed}"] = routed_fraction(run_dir)
            (kept / "routed_rows.json").write_text(json.dumps(
                {"what": "rows routed in training mode / top-K rows, final weights, 8 training batches "
                         "(scripts/repro/tr_quality.py routed_fraction)", "command": "python -m scripts.repro."
                 "tr_quality " + " ".join(sys.argv[1:] if argv is None else argv), **fractions}, indent=1) + "\n")
        files = {arm: sorted(kept.glob(f"{arm}.s*.metrics.jsonl"), key=lambda f: int(f.name.split(".")[1][1:]))
                 for arm in ARMS}
        if not all(files.values()):
            raise SystemExit(f"no proxy metrics in {rel(kept)}: run without --collect-only first")
        if (kept / "routed_rows.json").exists():
            fr = json.loads((kept / "routed_rows.json").read_text())
            routed = {arm: [fr[f.name.removesuffix(".metrics.jsonl")] for f in fs
                            if f.name.removesuffix(".metrics.jsonl") in fr] for arm, fs in files.items()}
        n_seeds = len(files["topk"])
        title = "CPU PROXY of Table 3a (tiny model, embedded corpus; not the paper's setup)"
        note = ("**CPU proxy, not the paper's setup**: configs/experiment/repro_tr_proxy.yaml, the tiny 4-layer d-128 "
                "model with E 16, K 2 (the 0.5B model's K/E = 1/8), n 64, tile 64, 2048 tokens per micro-batch, so "
                "T·K/E = 256 rows per expert = 4 tiles (the paper needs ≥ 2; its 0.5B run has 64), on the embedded "
                f"corpus (byte tokenizer: losses are nats per byte), {n_seeds} seed(s), fp32 on CPU. Metrics: "
                f"`{rel(kept)}/<arm>.s<seed>.metrics.jsonl`; routed-row fractions: `{rel(kept / 'routed_rows.json')}`. "
                f"Command: `python -m scripts.repro.tr_quality --proxy --seeds "
                f"{','.join(f.name.split('.')[1][1:] for f in files['topk'])}`.")
        name = "tr_proxy"
    else:
        dirs = dict(zip(ARMS, args.runs)) if args.runs else FULL_DIRS
        paths = {arm: Path(d) if str(d).endswith(".jsonl") else Path(d) / "metrics.jsonl" for arm, d in dirs.items()}
        missing = [rel(f) for f in paths.values() if not f.exists()]
        if missing:
            raise SystemExit("not run yet: " + ", ".join(missing) + " (see this script's docstring for the sweep)")
        files = {arm: [f] for arm, f in paths.items()}
        title = "Table 3a: token rounding quality, 0.5B 8/64"
        note = "Metrics: " + ", ".join(f"`{rel(f)}`" for f in paths.values()) + "."
        name = "tr_quality"
    summaries = {arm: [summarize(read_jsonl(f)) for f in fs] for arm, fs in files.items()}
    render(summaries, out_dir, name, title, note, routed)


if __name__ == "__main__":
    main()
