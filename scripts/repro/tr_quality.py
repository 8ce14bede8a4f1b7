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

Reduced GPU run (configs/experiment/repro_tr_0p5b_reduced.yaml: the 0.5B 8/64 model at the paper's
per-GPU batch, ~20M tokens of byte-level Python source instead of 20B of FineWeb-Edu, since the
GPU machines are offline): builds the corpus from this interpreter's sources, trains the three
arms one after another (run directories under --runs-dir, default runs/; each arm's is deleted
first), keeps their metrics under docs/repro/tr_reduced/ (--out-dir), and renders.
  python -m scripts.repro.tr_quality --reduced [--seeds 0,1] [--arm-timeout 180] [-- train.steps=500]
  python -m scripts.repro.tr_quality --reduced --collect-only
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import shutil
import sys
from pathlib import Path

from scripts.repro import paper
from scripts.repro.common import DOCS, RUNS, md_table, pyplot, python, read_jsonl, rel, run, save_figure, write_text
from sonic.data.local_text import build_code_corpus  # the reduced run's corpus (shared with data=local_bpe)

ARMS = {  # arm: (label, paper's column in TABLE_3A, train.py overrides)
    "topk": ("top-K", "topk", ["routing=topk"]),
    "nr_f": ("TR (NR-f)", "nr_f", ["routing=token_rounding"]),
    "drop": ("token drop (TR down)", "drop", ["routing=token_rounding", "model.moe.routing.rounding_mode=down"]),
}
REDUCED = "repro_tr_0p5b_reduced"
REDUCED_RUNS = "tr_0p5b_reduced"  # under --runs-dir: the reduced run's corpus and arm run directories
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


def run_proxy(seeds: list[int], steps: int | None, extra: list[str], runs_dir: Path) -> dict[tuple[str, int], Path]:
    """Train the three proxy arms for every seed, one after another, each from scratch, in runs_dir."""
    dirs = {}
    for seed in seeds:
        for arm, (_, _, overrides) in ARMS.items():
            run_dir = runs_dir / f"repro_tr_proxy_{arm}_s{seed}"
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


def run_reduced(seed: int, corpus_mb: int, arm_timeout: float | None, extra: list[str],
                runs_dir: Path) -> tuple[dict[str, Path], dict]:
    """The three arms of the reduced run for one seed, one after another on this GPU, in
    runs_dir/tr_0p5b_reduced; an arm past arm_timeout is killed and keeps the evaluations it logged
    (its curve is compared up to there)."""
    import torch  # noqa: PLC0415 - the device name for the report

    corpus = runs_dir / REDUCED_RUNS / "corpus.jsonl"
    info = {"date": datetime.date.today().isoformat(), "seed": seed,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
            "corpus": build_code_corpus(corpus, corpus_mb << 20), "commands": {}, "completed": {}}
    print(f"corpus {rel(corpus)}: {info['corpus']}", flush=True)
    dirs = {}
    for arm, (_, _, overrides) in ARMS.items():
        dirs[arm] = run_dir = runs_dir / REDUCED_RUNS / f"{arm}_s{seed}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        cmd = [python(), "train.py", f"experiment={REDUCED}", *overrides, f"train.seed={seed}",
               f"data.paths=[{rel(corpus)}]", f"train.run_dir={rel(run_dir)}", "train.resume=none", *extra]
        info["commands"][arm] = " ".join(["python", *cmd[1:]])
        info["completed"][arm] = run(cmd, timeout=arm_timeout)
    return dirs, info


def kept_metrics(kept: Path) -> dict[str, list[Path]]:
    """<arm>.s<seed>.metrics.jsonl files per arm, by seed."""
    return {arm: sorted(kept.glob(f"{arm}.s*.metrics.jsonl"), key=lambda f: int(f.name.split(".")[1][1:]))
            for arm in ARMS}


def logged_mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else None


def reduced_note(kept: Path, infos: list[dict], files: dict[str, list[Path]]) -> str:
    """What the reduced run is, from its kept run.s<seed>.json files and metrics."""
    info = infos[0] if infos else {}
    corpus = info.get("corpus", {})
    speed = []
    for arm, fs in files.items():
        rows = [r for f in fs for r in read_jsonl(f) if r["step"] > 10]  # past the first-step compile
        tps, mfu = logged_mean(rows, "tokens_per_s_per_gpu"), logged_mean(rows, "mfu")
        if tps:
            speed.append(f"{ARMS[arm][0]} {tps / 1e3:.0f}k tokens/s" + (f" (MFU {100 * mfu:.1f}%)" if mfu else ""))
    cut = sorted({f"{ARMS[a][0]} seed {i['seed']}" for i in infos for a, ok in i.get("completed", {}).items() if not ok})
    warn = [f"cut by the time box before their last step: {', '.join(cut)}"] if cut else []
    if len({i.get("corpus", {}).get("sha256") for i in infos}) > 1:
        warn.append("the seeds trained on different corpora (see run.s*.json)")
    return ("**Reduced run, not the paper's data or length**: configs/experiment/repro_tr_0p5b_reduced.yaml, the "
            "0.5B 8/64 architecture (12 layers, d 768, E 64, K 8, n 256, tile 128) and recipe (lr 6e-4 cosine, 10% "
            "warmup, wd 0.01, aux 0.01) at the paper's per-GPU micro-batch of 16 × 4096 tokens (T·K/E = 64 tiles "
            f"per expert), on one {info.get('device', 'GPU')}, kernel backend triton, seeds "
            f"{', '.join(str(i['seed']) for i in infos)} (differences are paired by seed). Data: byte-level Python "
            f"source ({corpus.get('documents', '?')} files, {corpus.get('bytes', 0) / 2**20:.0f} MiB of the GPU "
            f"machine's Python {corpus.get('python', '?')} stdlib and site-packages, sha256 "
            f"{corpus.get('sha256', '?')[:12]}), because FineWeb-Edu cannot reach the GPU machines; losses are nats "
            "per byte. " + (f"**Not like for like**: {'; '.join(warn)}. " if warn else "")
            + ("Training speed (steady state): " + "; ".join(speed) + ". " if speed else "")
            + f"Metrics, corpus and commands: `{rel(kept)}/`. Commands: "
            + "; ".join(f"`{i['command']}`" for i in infos if i.get("command")) + ".")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--proxy", action="store_true", help="the CPU proxy (configs/experiment/repro_tr_proxy.yaml)")
    mode.add_argument("--reduced", action="store_true", help=f"the one-GPU reduced run (configs/experiment/{REDUCED}.yaml)")
    ap.add_argument("--seeds", default="0", help="--proxy/--reduced: comma list of train.seed values (each runs all arms)")
    ap.add_argument("--collect-only", action="store_true", help="--proxy/--reduced: render the kept metrics, train nothing")
    ap.add_argument("--steps", type=int, default=None, help="--proxy: override train.steps")
    ap.add_argument("--corpus-mb", type=int, default=48, help="--reduced: MiB of Python source to train on")
    ap.add_argument("--arm-timeout", type=float, default=None, help="--reduced: seconds per arm before it is cut")
    ap.add_argument("--runs", nargs=3, metavar=("TOPK", "NR_F", "DROP"), default=None,
                    help="run directories (or metrics.jsonl files) of the three arms")
    ap.add_argument("--out-dir", default=str(DOCS))
    ap.add_argument("--runs-dir", default=str(RUNS), help="--proxy/--reduced: where the arms' run directories go "
                                                          "(deleted first: each arm starts afresh)")
    ap.add_argument("extra", nargs="*", help="after --: further train.py overrides for the proxy or reduced runs")
    args = ap.parse_args(argv)
    out_dir = Path(args.out_dir)
    command = "python -m scripts.repro.tr_quality " + " ".join(sys.argv[1:] if argv is None else argv)

    routed: dict[str, list[float]] = {}
    if args.proxy:
        kept = out_dir / "tr_proxy"
        if not args.collect_only:
            seeds = [int(v) for v in args.seeds.split(",")]
            dirs = run_proxy(seeds, args.steps, args.extra, Path(args.runs_dir))
            if kept.exists():
                shutil.rmtree(kept)  # the kept metrics are exactly this invocation's runs
            kept.mkdir(parents=True)
            fractions = {}
            for (arm, seed), run_dir in dirs.items():
                shutil.copy(run_dir / "metrics.jsonl", kept / f"{arm}.s{seed}.metrics.jsonl")
                fractions[f"{arm}.s{seed}"] = routed_fraction(run_dir)
            (kept / "routed_rows.json").write_text(json.dumps(
                {"what": "rows routed in training mode / top-K rows, final weights, 8 training batches "
                         "(scripts/repro/tr_quality.py routed_fraction)", "command": command, **fractions},
                indent=1) + "\n")
        files = kept_metrics(kept)
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
    elif args.reduced:
        kept = out_dir / "tr_reduced"
        if not args.collect_only:
            kept.mkdir(parents=True, exist_ok=True)  # other seeds' kept runs stay
            for seed in (int(v) for v in args.seeds.split(",")):
                dirs, info = run_reduced(seed, args.corpus_mb, args.arm_timeout, args.extra, Path(args.runs_dir))
                for arm, run_dir in dirs.items():
                    if (run_dir / "metrics.jsonl").exists():
                        shutil.copy(run_dir / "metrics.jsonl", kept / f"{arm}.s{seed}.metrics.jsonl")
                (kept / f"run.s{seed}.json").write_text(json.dumps({"command": command, **info}, indent=1) + "\n")
        files = {arm: fs for arm, fs in kept_metrics(kept).items() if fs}
        if "topk" not in files:
            raise SystemExit(f"no reduced-run metrics in {rel(kept)}: run --reduced on a GPU first")
        infos = [json.loads(f.read_text()) for f in sorted(kept.glob("run.s*.json"))]
        routed = {arm: [v for f in fs if (v := logged_mean(read_jsonl(f), "routed_rows_ratio")) is not None]
                  for arm, fs in files.items()}
        title = "REDUCED Table 3a on one GPU (0.5B 8/64 model, 20M tokens of code; not the paper's data or length)"
        note = reduced_note(kept, infos, files)
        name = "tr_reduced"
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
