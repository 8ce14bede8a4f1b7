"""Whether bf16 AdamW moments (optim.moment_dtype=bf16) change the loss curve: the real trainer, twice on the same
batches and seed, once with fp32 moments and once with bf16 ones.

    python -m bench.moments [--steps 500] [override ...]

Every argument after the options is a Hydra override, as for train.py (default: the tiny model on the embedded
corpus, `model=tiny data=embedded`). Logs every 10 steps. Writes --json (default
bench/results/<date>-<gpu>-moments.json): both loss curves, the largest gap between them relative to the fp32
curve's loss, and the gap of the means over the last 100 steps. Meant for a GPU (bf16 moments are triton's AdamW).
"""
from __future__ import annotations

import argparse
import tempfile

from bench.common import compose_config, result_path, write_json
from sonic.train.trainer import train

DEFAULTS = ["model=tiny", "data=embedded", "train.log_every=10", "train.eval_every=0", "train.save_every=0",
            "train.lm_eval_every=0", "train.progress=false", "train.resume=none"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--json", default=None)
    args, overrides = ap.parse_known_args(argv)
    curves = {}
    for dtype in ("fp32", "bf16"):
        with tempfile.TemporaryDirectory() as run_dir:
            history = train(compose_config([*DEFAULTS, f"train.steps={args.steps}", f"train.run_dir={run_dir}",
                                            *overrides, f"optim.moment_dtype={dtype}"]))
        curves[dtype] = {r["step"]: r["loss"] for r in history}
    steps = sorted(curves["fp32"])
    gaps = [abs(curves["bf16"][s] - curves["fp32"][s]) / curves["fp32"][s] for s in steps]
    tail = [s for s in steps if s > steps[-1] - 100]
    mean = {k: sum(curves[k][s] for s in tail) / len(tail) for k in curves}
    summary = {"max_relative_gap": max(gaps), "last_100_steps_mean_loss": mean,
               "last_100_steps_relative_gap": (mean["bf16"] - mean["fp32"]) / mean["fp32"]}
    for s in steps[::5] + ([steps[-1]] if steps[-1] not in steps[::5] else []):
        print(f"  step {s:5d}: loss fp32 {curves['fp32'][s]:.4f}  bf16 {curves['bf16'][s]:.4f}")
    print(f"largest gap {summary['max_relative_gap']:.2%} of the fp32 loss; last 100 steps' mean "
          f"{mean['fp32']:.4f} (fp32) vs {mean['bf16']:.4f} (bf16), {summary['last_100_steps_relative_gap']:+.2%}")
    path = result_path("moments", args.json)
    write_json(path, {"overrides": DEFAULTS + overrides, "steps": args.steps, **summary,
                      "loss": {k: [[s, v[s]] for s in steps] for k, v in curves.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
