"""The run configuration: one dataclass per component, composed by Hydra from configs/."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from sonic.data import DataConfig
from sonic.models.config import ModelConfig
from sonic.parallel.config import ParallelConfig
from sonic.train.guard import NONFINITE_POLICIES
from sonic.train.loggers import WandbConfig
from sonic.train.optim import OptimConfig

PRECISIONS = ("auto", "bf16", "fp32")


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps
    micro_batch_size: int = 16  # sequences per rank per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seq_len: int = 128
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    document_masking: bool = False  # block attention across packed documents
    log_every: int = 10
    eval_every: int = 100  # validation loss every N steps (and at the end); 0 disables
    eval_batches: int = 8
    save_every: int = 100  # checkpoint every N steps (and at the end); 0 disables
    keep_last: int = 2  # complete checkpoints kept on disk
    resume: str = "auto"  # auto: newest complete checkpoint in run_dir, if any | none | a checkpoint path
    run_dir: str = "runs/${model.name}"  # checkpoints, metrics.jsonl and Hydra's logs
    progress: bool = True  # progress bar on rank 0
    peak_tflops: float = 0.0  # per-GPU peak for MFU; 0 = look it up from the GPU name
    init_from: str | None = None  # start (not resume) from these weights: a Sonic checkpoint, file or HF directory
    init_from_strict: bool = True  # HF init_from: config.json fields that change the computation must match model.*
    lm_eval_every: int = 0  # lm-eval tasks every N steps (and at the end); 0 disables
    lm_eval_tasks: list[str] = field(default_factory=lambda: ["sonic_world"])
    lm_eval_limit: int | None = None  # examples per task; None = all
    # A step whose global grad norm is not finite: skip it (weights and optimizer state unchanged,
    # counted as skipped_steps) or stop before applying it. skip, because under a requeue loop a
    # stop would resume into the same batch and fail again; see sonic/train/guard.py.
    nonfinite: str = "skip"  # skip | stop
    max_consecutive_skips: int = 10  # stop once this many steps in a row were skipped (a diverged run)

    def __post_init__(self):
        for name in ("steps", "micro_batch_size", "grad_accum", "seq_len", "log_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        for name in ("eval_every", "save_every", "keep_last", "lm_eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 0 (0 disables)")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"train.nonfinite={self.nonfinite!r} is not one of {', '.join(NONFINITE_POLICIES)}")
        if self.max_consecutive_skips < 1:
            raise ValueError(f"train.max_consecutive_skips={self.max_consecutive_skips} must be >= 1; a run that "
                             f"skips every step never stops on its own")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self):
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        if self.model.moe.num_experts % self.parallel.ep:
            raise ValueError(f"parallel.ep={self.parallel.ep} does not divide model.moe.num_experts="
                             f"{self.model.moe.num_experts}: every ep rank holds the same number of experts; "
                             f"pick a divisor of the expert count")
        routing = self.model.moe.routing
        if self.parallel.ep > 1 and routing.method == "token_rounding" and routing.rounding_mode == "nearest_score":
            raise ValueError("routing.rounding_mode=nearest_score is not supported with parallel.ep > 1 (it needs "
                             "the ep group's ranked gate sums); use nearest, stochastic or balance")


def register_schema() -> None:
    """Make the dataclasses Hydra's schema, so every field can be overridden from the
    command line and typos fail at composition (configs/config.yaml lists `_schema`)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="_schema", node=Config)


class CheckRunDir(Callback):
    """Hydra creates train.run_dir (its run directory, for its logs) before train() starts: check it
    first, so that an unwritable one gets our message, not a bare NotADirectoryError or PermissionError.
    configs/config.yaml registers it under hydra.callbacks."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        from sonic.train.checkpoint import check_run_dir

        try:
            check_run_dir(Path(config.train.run_dir))
        except ValueError as err:  # Hydra turns a callback's exceptions into warnings and goes on
            raise SystemExit(f"ValueError: {err}") from err


def to_config(raw: DictConfig | dict) -> Config:
    """Validate a composed Hydra config against the dataclasses (unknown keys and bad
    types fail here with OmegaConf's message; bad values fail in __post_init__)."""
    raw = OmegaConf.create(raw) if isinstance(raw, dict) else raw
    raw = OmegaConf.masked_copy(raw, [k for k in raw.keys() if k != "hydra"]) if "hydra" in raw else raw
    merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
    OmegaConf.resolve(merged)
    return OmegaConf.to_object(merged)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
