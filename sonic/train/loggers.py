"""Metric sinks: compact console lines and Weights & Biases (disabled | offline | online)."""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("sonic")

WANDB_MODES = ("disabled", "offline", "online")
RUN_ID_FILE = "wandb_run_id"  # in the run directory: the wandb run a resume continues


@dataclass
class WandbConfig:
    mode: str = "disabled"  # disabled | offline (no network; sync later) | online
    project: str = "sonic"
    name: str | None = None  # None: the run directory's name
    entity: str | None = None

    def __post_init__(self):
        if self.mode not in WANDB_MODES:
            raise ValueError(f"wandb.mode={self.mode!r} is not one of {', '.join(WANDB_MODES)}")


CONSOLE_KEYS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s_per_gpu", "btokens_per_day", "mfu_causal",
                "mfu", "mem_peak_gib", "aux_loss")


class MetricLogger:
    """Logs on rank 0 only; every metric keeps one name everywhere.

    A run that resumes from a checkpoint (resume=True) continues the wandb run whose id is stored in
    the run directory; a run that starts from step 0 starts a new one and stores its id there."""

    def __init__(self, cfg: WandbConfig, run_dir: str, config: dict[str, Any], enabled: bool, resume: bool = False):
        self.enabled = enabled
        self.run = None
        if enabled and cfg.mode != "disabled":
            import wandb

            id_file = Path(run_dir) / RUN_ID_FILE
            run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
            if not run_id:
                run_id = secrets.token_hex(6)  # wandb's id alphabet: letters and digits
                id_file.parent.mkdir(parents=True, exist_ok=True)
                id_file.write_text(run_id + "\n")
            # resume="allow": the same run id continues that run (a replayed step keeps its first values,
            # which a bit-exact resume logs alike)
            self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name, dir=run_dir, id=run_id,
                                  mode=cfg.mode, config=config, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        shown = " ".join(f"{k} {_fmt(metrics[k])}" for k in CONSOLE_KEYS if k in metrics)
        log.info("step %d | %s", step, shown)
        if self.run is not None:
            self.run.log(metrics, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def _fmt(v: float) -> str:
    return f"{v:.3e}" if abs(v) < 1e-2 and v != 0 else f"{v:.4g}"
