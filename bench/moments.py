"""Whether AdamW's lower-precision state changes the loss curve: the real trainer, twice on the same batches and
seed, once with fp32 state and once with the bf16 one.

    python -m bench.moments [--steps 500] [--compare moments|masters] [override ...]

--compare moments (default): fp32 against bf16 moments (optim.moment_dtype); masters: the bf16 weights of one GPU
with fp32 masters against none, stepped in place with stochastic rounding (optim.master_weights).

Every argument after the options is a Hydra override, as for train.py (default: the tiny model on the embedded
corpus, `model=tiny data=embedded`). Logs every 10 steps. Writes --json (default
bench/results/<date>-<gpu>-moments.json, or -masters.json): both loss curves (keyed by the option's value), the
largest gap between them relative to the fp32 curve's loss, and the gap of the means over the last 100 steps.
Meant for a GPU (both are triton's AdamW).
"""
from __future__ import annotations

import argparse
import tempfile

from bench.common import compose_config, result_path, write_json
from sonic.train.trainer import train

DEFAULTS = ["model=tiny", "data=embedded", "train.log_every=10", "train.eval_every=0", "train.save_every=0",
            "train.lm_eval_every=0", "train.progress=false", "train.resume=none"]
# --compare: (the option, (its fp32 value, its bf16 one))
COMPARE = {"moments": ("optim.moment_dtype", ("fp32", "bf16")), "masters": ("optim.master_weights", ("fp32", "none"))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--compare", choices=sorted(COMPARE), default="moments")
    ap.add_argument("--json", default=None)
    args, overrides = ap.parse_known_args(argv)
    option, (base, low) = COMPARE[args.compare]
    curves = {}
    for value in (base, low):
        with tempfile.TemporaryDirectory() as run_dir:
            history = train(compose_config([*DEFAULTS, f"train.steps={args.steps}", f"train.run_dir={run_dir}",
                                            *overrides, f"{option}={value}"]))
        curves[value] = {r["step"]: r["loss"] for r in history}
    steps = sorted(curves[base])
    gaps = [abs(curves[low][s] - curves[base][s]) / curves[base][s] for s in steps]
    tail = [s for s in steps if s > steps[-1] - 100]
    mean = {k: sum(curves[k][s] for s in tail) / len(tail) for k in curves}
    summary = {"option": option, "max_relative_gap": max(gaps), "last_100_steps_mean_loss": mean,
               "last_100_steps_relative_gap": (mean[low] - mean[base]) / mean[base]}
    for s in steps[::5] + ([steps[-1]] if steps[-1] not in steps[::5] else []):
        print(f"  step {s:5d}: loss {base} {curves[base][s]:.4f}  {low} {curves[low][s]:.4f}")
    print(f"{option}: largest gap {summary['max_relative_gap']:.2%} of the {base} loss; last 100 steps' mean "
          f"{mean[base]:.4f} ({base}) vs {mean[low]:.4f} ({low}), {summary['last_100_steps_relative_gap']:+.2%}")
    path = result_path("moments" if args.compare == "moments" else "masters", args.json)
    write_json(path, {"overrides": DEFAULTS + overrides, "steps": args.steps, **summary,
                      "loss": {k: [[s, v[s]] for s in steps] for k, v in curves.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
