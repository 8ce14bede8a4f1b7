"""Where the real trainer's step leaves the GPU idle: train.py's loop, on the config its overrides give, with a few
steps under torch.profiler.

    python -m bench.trainer_profile [--at 26] [--profile-steps 2] [override ...]

Every argument after the options is a Hydra override, as for train.py (default: the 40-layer sonic_7b of the e2e
table, `experiment=sonic_7b data=local_bpe model.num_layers=40`, micro-batch 4 x 4096, --at + --profile-steps + 6
steps). Unlike `bench.train_step`, which times a step of its own on random tokens, this is the step users run:
the data loader, the batch copies, the logging, the clip, the guard and AdamW as the trainer calls them.

Steps --at to --at + --profile-steps - 1 (0-based) run under the profiler, CUDA kernels and the host calls that
launch them; `bench.common.gpu_gaps` then says how long the GPU idled between kernels and whether it waited for
the host there. Also the host's wall time of every step (the profiled ones are slower) and the trainer's logged
tokens/s. Writes --json (default bench/results/<date>-<gpu>-trainer_profile.json). On a CPU it profiles CPU
operators only (a smoke test of this script: no gaps).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import sonic.train.trainer as trainer
from bench.common import compose_config, gpu_gaps, kernel_times, result_path, write_json

DEFAULTS = ["experiment=sonic_7b", "data=local_bpe", "model.num_layers=40", "train.seq_len=4096",
            "train.micro_batch_size=4", "train.log_every=5", "train.eval_every=0", "train.save_every=0",
            "train.lm_eval_every=0", "train.progress=false", "train.resume=none"]


class StepProfiler:
    """Stands in for the trainer's set_lr, which its loop calls once at the start of every step: times each step
    and runs steps [at, at + n) under torch.profiler."""

    def __init__(self, set_lr, at: int, n: int, cuda: bool, trace_dir: str):
        self.set_lr, self.at, self.n, self.cuda, self.trace_dir = set_lr, at, n, cuda, trace_dir
        self.step, self.started, self.walls_ms = 0, None, []
        self.prof, self.result = None, None

    def __call__(self, *args, **kwargs):
        now = time.perf_counter()
        if self.started is not None:
            self.walls_ms.append(1e3 * (now - self.started))
        if self.step in (self.at, self.at + self.n) and self.cuda:
            torch.cuda.synchronize()  # the profile holds these steps' work and no other
        if self.step == self.at:
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
        elif self.step == self.at + self.n:
            self.finish()
        self.step += 1
        self.started = time.perf_counter()
        return self.set_lr(*args, **kwargs)

    def finish(self) -> None:
        self.prof.__exit__(None, None, None)
        trace = Path(self.trace_dir) / "trace.json"
        self.prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        per_step = lambda ms: ms / self.n  # noqa: E731
        gaps = gpu_gaps(events)
        self.result = {
            "gaps_per_step": {k: per_step(v) for k, v in gaps.items() if isinstance(v, float)},
            "gaps": gaps,
            "top_ms_per_step": [(name, per_step(ms), calls // self.n)
                                for name, ms, calls in kernel_times(self.prof, self.cuda)[:40]]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--at", type=int, default=26, help="the first profiled step (0-based; after compile warm-up)")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--json", default=None)
    args, overrides = ap.parse_known_args(argv)
    steps = args.at + args.profile_steps + 6
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_config([*DEFAULTS, f"train.steps={steps}", f"train.run_dir={tmp}/run", *overrides])
        if cfg.train.steps <= args.at + args.profile_steps:
            raise SystemExit(f"train.steps={cfg.train.steps} ends before the profile does (--at {args.at}, "
                             f"--profile-steps {args.profile_steps}); raise it or lower --at")
        cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
        profiler = StepProfiler(trainer.set_lr, args.at, args.profile_steps, cuda, tmp)
        trainer.set_lr = profiler  # the loop's one call per step
        try:
            history = trainer.train(cfg)
        finally:
            trainer.set_lr = profiler.set_lr
    walls = profiler.walls_ms
    after = walls[args.at + args.profile_steps:]
    payload = {"overrides": [*DEFAULTS, *overrides], "steps": cfg.train.steps, "profiled_steps":
               [args.at, args.at + args.profile_steps - 1], **profiler.result, "step_wall_ms": walls,
               "step_wall_ms_after_profile_median": sorted(after)[len(after) // 2] if after else None,
               "tokens_per_s_per_gpu": [(r["step"], r.get("tokens_per_s_per_gpu")) for r in history]}
    path = write_json(result_path("trainer_profile", args.json), payload)
    gaps = payload["gaps_per_step"]
    if gaps:
        print(f"per profiled step: span {gaps['span_ms']:.1f} ms, GPU busy {gaps['busy_ms']:.1f}, idle "
              f"{gaps['idle_ms']:.1f} (waiting for the host {gaps['idle_host_bound_ms']:.1f})")
    print(f"median wall ms per step after the profile: {payload['step_wall_ms_after_profile_median']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
