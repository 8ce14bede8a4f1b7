"""Reach the first training step of a large preset with meta-device init; record each rank's memory.

    torchrun --nproc-per-node 2 -m scripts.first_step --json first_step.json \\
        model=qwen3_30b_a3b model.num_layers=8

Runs the real trainer (sonic.train.trainer.train) for one optimizer step from a fresh start,
with no evaluation and no checkpoint; every argument after the options is a Hydra override, as
for train.py (add train.seq_len=..., train.micro_batch_size=..., parallel.* as needed). The
model is built on `meta`, sharded, and each rank initialises only its shards, so memory after
init is about 1/world of the fp32 model, not all of it. Writes --json with each rank's memory
after init (torch.cuda.memory_allocated and max_memory_allocated; on CPU the bytes of the
model's local tensors), the first step's loss and peak memory, and prints a table last.
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from hydra import compose, initialize_config_dir

from bench.common import write_json
from sonic.models import param_counts
from sonic.train.config import register_schema, to_config
from sonic.train.trainer import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# One step from scratch, nothing else; overrides given on the command line come later and win.
DEFAULTS = ["train.steps=1", "train.log_every=1", "train.eval_every=0", "train.save_every=0", "train.lm_eval_every=0",
            "train.resume=none", "train.progress=false", "train.run_dir=runs/first_step/${model.name}"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="where to write the result")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    register_schema()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = to_config(compose(config_name="config", overrides=[*DEFAULTS, *args.overrides]))
    history = train(cfg)  # on every rank; each gets the same logged metrics back
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))  # torchrun's
    if rank != 0:
        return
    first = history[0]
    keys = [k for k in ("mem_after_init_gib", "mem_after_init_peak_gib") if k in first]
    per_rank = [{"rank": r, **{k: first[f"{k}/{r}"] for k in keys}} for r in range(world)]
    counts = param_counts(cfg.model)
    full_gib = counts.total * 4 / 2**30  # what every rank held after init before meta init
    path = write_json(Path(args.json), {
        "world_size": world, "overrides": args.overrides, "model": cfg.model.name,
        "num_layers": cfg.model.num_layers, "params_total": counts.total, "params_active": counts.active,
        "full_model_fp32_gib": full_gib, "per_rank": per_rank,
        "first_step": {k: v for k, v in first.items() if "/" not in k}})
    print(f"\n{cfg.model.name}, {cfg.model.num_layers} layers: {counts.total / 1e9:.2f}B params = "
          f"{full_gib:.2f} GiB in fp32 (1/{world} = {full_gib / world:.2f} GiB); step 1 loss {first['loss']:.4f}, "
          f"peak {first.get('mem_peak_gib', float('nan')):.2f} GiB")
    print(f"{'rank':>4} " + " ".join(f"{k:>24}" for k in keys))
    for row in per_rank:
        print(f"{row['rank']:>4} " + " ".join(f"{row[k]:>24.3f}" for k in keys))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
