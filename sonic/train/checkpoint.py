"""Checkpoints that are atomic and resume bit-exactly, single process or FSDP-2.

Layout of one checkpoint, <dir>/step_00000100/:
  .metadata, *.distcp   model + optimizer (torch.distributed.checkpoint: any world size)
  extra_rank<r>.pt      scheduler, data-loader position, RNG states and model buffers of rank r
  config.yaml           the resolved run config (eval and HF export read it)
  meta.json             written last; its presence marks the checkpoint complete
Everything is written into step_XXXXXXXX.tmp and renamed once complete, so a crash
mid-save never leaves a directory that `resume: auto` would pick.

Buffers (e.g. the router's balance residual) may differ between ranks, while DCP keeps one
copy of an unsharded tensor; each rank therefore also keeps its own in extra_rank<r>.pt and
gets it back on a resume at the same world size (another world size takes DCP's copy).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from sonic.models.loading import complete_checkpoints



def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _clean(name: str) -> str:
    """Parameter/buffer name without activation-checkpoint or compile wrapper prefixes."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[_clean(f"{prefix}.{name}" if prefix else name)] = buf
    return out


class Checkpointer:
    def __init__(self, root: str | Path, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, model, optimizer, extra: dict[str, Any], config_yaml: str) -> Path:
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
        buffers = {k: v.detach().cpu() for k, v in persistent_buffers(model).items()}
        torch.save({**extra, "rng": rng_state(), "buffers": buffers}, tmp / f"extra_rank{_rank()}.pt")
        _barrier()
        if _rank() == 0:
            (tmp / "config.yaml").write_text(config_yaml)
            (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": _world()}))
            if final.exists():  # an older save of the same step (e.g. after a rollback)
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in complete_checkpoints(self.root)[:-self.keep_last] if self.keep_last > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def find(self, resume: str) -> Path | None:
        """Checkpoint to resume from: 'none', 'auto' (newest complete one, if any) or a path."""
        if resume == "none":
            return None
        if resume == "auto":
            found = complete_checkpoints(self.root)
            return found[-1] if found else None
        path = Path(resume)
        if not (path / "meta.json").is_file():
            raise ValueError(f"train.resume={resume!r} is not a complete checkpoint directory (no meta.json); "
                             f"point it at a step_XXXXXXXX directory, or use train.resume=auto|none")
        return path

    def load(self, path: Path, model, optimizer) -> dict[str, Any]:
        """Restore model and optimizer in place; return this rank's extra state (RNG applied)."""
        try:
            meta = json.loads((path / "meta.json").read_text())
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        except (Exception, dcp.api.CheckpointException) as err:  # noqa: BLE001 - DCP's is a BaseException
            raise ValueError(f"checkpoint {path} is corrupt or incompatible with this model ({err}); "
                             f"delete it to fall back to an older one, or set train.resume=none") from err
        same_world = meta["world_size"] == _world()
        extra_file = path / f"extra_rank{_rank() if same_world else 0}.pt"
        extra = torch.load(extra_file, weights_only=False)
        if same_world:
            set_rng_state(extra["rng"])
            buffers = persistent_buffers(model)
            with torch.no_grad():
                for name, saved in extra.get("buffers", {}).items():
                    buffers[name].copy_(saved)
        else:
            warnings.warn(f"resuming a {meta['world_size']}-rank checkpoint on {_world()} ranks: model, optimizer "
                          f"and schedule are restored; the data order and RNG restart from the seed")
            extra.pop("loader", None)
        extra["step"] = meta["step"]
        return extra
