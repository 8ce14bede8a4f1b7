"""The run configuration: one dataclass per component, composed by Hydra from configs/."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from sonic.data import DataConfig
from sonic.models import Transformer
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
    # Skip a step whose AdamW update could exceed this multiple of the weight norm: AdamW moves each
    # weight by about lr, so the bound is lr*sqrt(#weights) (e.g. optim.lr=1e6; see guard.py). 0 disables.
    max_update_ratio: float = 1.0

    def __post_init__(self):
        for name in ("steps", "micro_batch_size", "grad_accum", "seq_len", "log_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        for name in ("eval_every", "save_every", "keep_last", "lm_eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 0 (0 disables)")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"train.nonfinite={self.nonfinite!r} is not one of {', '.join(NONFINITE_POLICIES)}")
        if self.max_update_ratio < 0:
            raise ValueError(f"train.max_update_ratio={self.max_update_ratio} must be >= 0 (0 disables the check)")
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
    """Validate a composed Hydra config against the dataclasses (bad values fail in __post_init__)."""
    return to_dataclass(Config, raw)


def to_dataclass(schema: type, raw: DictConfig | dict) -> Any:
    """`raw` (a composed Hydra config, its `hydra` node left out) as an instance of dataclass `schema`.

    Unknown keys fail with OmegaConf's message, the one Hydra prints for `train.stepz=5`. Hydra adds
    `+train.stepz=5` to the composed config even though it is typed by the schema (the `+` form
    opens the node), so the config is merged into the schema again here as plain data."""
    plain = OmegaConf.to_container(raw, resolve=False) if isinstance(raw, DictConfig) else dict(raw)
    plain.pop("hydra", None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), plain)
    except ConfigKeyError as err:
        raise ValueError(f"Could not override '{err.full_key}'.\n{err}") from None
    OmegaConf.resolve(merged)
    return OmegaConf.to_object(merged)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# ------------------------------------------------------------------ config changes on resume
RESUME_ONLY = ("train.resume",)  # how to start, not what to train: never a change
# other fields a checkpoint cannot follow, and why (model fields: see check_resume_config)
FIXED = {"optim.decay_norms_and_embeddings": "it regroups the parameters of the optimizer's saved state"}


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists and empty dicts are values."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Transformer(model).state_dict().items()}


def _model_with(model: dict, key: str, value: Any) -> ModelConfig:
    changed = OmegaConf.create(model)
    OmegaConf.update(changed, key, value, merge=False)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), changed))


def check_resume_config(saved_yaml: str, cfg: Config, checkpoint: Path) -> dict[str, tuple[Any, Any]]:
    """Compare the config a checkpoint was saved with (its config.yaml) with this run's: return every
    changed field as {field: (saved, now)}, after raising a ValueError if one changes the model's
    weights (their names or shapes: layers, experts, dims, vocab...), which cannot be loaded."""
    saved = OmegaConf.to_container(OmegaConf.create(saved_yaml), resolve=True)
    now = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    old, new = _flat(saved), _flat(now)
    changes = {k: (old[k], new[k]) for k in new if k in old and old[k] != new[k] and k not in RESUME_ONLY}
    fixed = [k for k in changes if k in FIXED]
    if fixed:
        raise ValueError(f"cannot resume {checkpoint} with " + "; ".join(
            f"{k}: checkpoint {changes[k][0]!r}, now {changes[k][1]!r} ({FIXED[k]})" for k in fixed)
            + ". Resume with the checkpoint's value (its config.yaml), or start a new run")
    model_changes = {k.removeprefix("model."): v for k, v in changes.items() if k.startswith("model.")}
    if model_changes:
        try:
            before = _shapes(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved["model"])))
        except Exception:  # noqa: BLE001 - a model config this version cannot read: loading the weights says why
            before = None
        if before is not None and before != _shapes(cfg.model):
            blamed = []
            for key, (_, value) in model_changes.items():
                try:
                    if _shapes(_model_with(saved["model"], key, value)) != before:
                        blamed.append(key)
                except (ValueError, TypeError):  # the change is only valid together with another one
                    blamed.append(key)
            what = "; ".join(f"model.{k}: checkpoint {model_changes[k][0]!r}, now {model_changes[k][1]!r}"
                             for k in blamed or model_changes)
            raise ValueError(f"cannot resume {checkpoint} with a different model shape ({what}): its weights do "
                             f"not fit. Resume with the checkpoint's values (its config.yaml), start a new run "
                             f"(another train.run_dir, or train.resume=none), or start from its weights where they "
                             f"fit with train.init_from")
    return changes
