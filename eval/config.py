"""Configuration of `python -m eval` (a Hydra structured config; defaults in eval/conf/eval.yaml)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from sonic.train.config import PRECISIONS


@dataclass
class EvalConfig:
    checkpoint: str = "???"  # step dir, run dir, .safetensors/.pt file, or HF OLMoE/Qwen3-MoE directory
    tasks: list[str] = field(default_factory=lambda: ["sonic_world"])  # sonic_paper = the paper's 11 tasks
    limit: Optional[float] = None  # examples per task (>= 1) or a fraction (< 1); null = all
    num_fewshot: Optional[int] = None  # null = each task's default (0 for the paper's tasks)
    batch_size: int = 16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    kernel_backend: str = "auto"  # overrides the checkpoint's (a GPU backend may not run here)
    tokenizer: Optional[str] = None  # null = the checkpoint's data.tokenizer
    output_dir: Optional[str] = None  # null = <checkpoint>/eval (a file: <file>.eval)
    bootstrap_iters: int = 1000  # lm-eval stderr resamples (0 = none; mean metrics use a closed form)
    seed: int = 0

    def __post_init__(self):
        if self.checkpoint in ("???", ""):
            raise ValueError("checkpoint is required: python -m eval checkpoint=runs/tiny/checkpoints/step_00000300")
        if not self.tasks:
            raise ValueError("tasks is empty; e.g. tasks=[sonic_world] or tasks=[sonic_paper]")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"limit={self.limit} must be > 0 (or null for every example)")
        if self.limit is not None and self.limit >= 1:
            if self.limit != int(self.limit):
                raise ValueError(f"limit={self.limit}: a count must be whole (a fraction must be < 1)")
            self.limit = int(self.limit)
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"num_fewshot={self.num_fewshot} must be >= 0")
        if self.bootstrap_iters < 0:
            raise ValueError(f"bootstrap_iters={self.bootstrap_iters} must be >= 0")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
