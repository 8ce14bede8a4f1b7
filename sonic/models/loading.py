"""Load a Sonic model (weights + ModelConfig + tokenizer name) from whatever a user points at.

Accepted paths, so eval and export take the same argument:
  a checkpoint directory step_XXXXXXXX (DCP shards, config.yaml, meta.json; see sonic/train/checkpoint.py)
  a run directory or a checkpoints directory: its newest complete checkpoint
  a single file model.safetensors / model.pt written by `save_model_file`
  a Hugging Face OLMoE / Qwen3-MoE directory (config.json + safetensors), converted by sonic.models.hf
The checkpoint layout is defined here (models stays below train, which writes it).
"""
from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException

from sonic.models.config import ModelConfig
from sonic.models.transformer import Transformer

STEP_DIR = re.compile(r"^step_(\d{8})$")  # the checkpoint layout, shared with sonic/train/checkpoint.py
_CONFIG_KEY = "sonic_config"  # safetensors metadata / .pt key holding the config YAML
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class LoadedModel:
    model: Transformer  # in eval mode, on the requested device
    config: ModelConfig
    tokenizer: str | None  # the run's data.tokenizer ('byte', a name or a directory); None if unknown
    path: Path  # what was actually read (e.g. the newest step directory of a run)
    step: int | None  # training step of a DCP checkpoint


def load_model(path: str | Path, device: str | torch.device = "cpu",
               kernel_backend: str | None = None) -> LoadedModel:
    """Build the model of `path` and load its weights; a ValueError names the path on any failure.

    kernel_backend overrides the checkpoint's moe.kernel_backend (a GPU run may name a backend
    that cannot run where you evaluate; 'auto' picks what works here).
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    resolved = resolve_checkpoint(path)
    try:
        if resolved.is_file():
            cfg, tokenizer, state, step = *_read_file(resolved), None
        elif (resolved / "config.json").is_file():
            from sonic.models.hf import import_hf

            cfg, state = import_hf(resolved)
            tokenizer, step = (str(resolved) if _has_tokenizer(resolved) else None), None
        else:
            cfg, tokenizer = _read_config_yaml(resolved / "config.yaml")
            state, step = None, json.loads((resolved / "meta.json").read_text())["step"]
    except ValueError as err:
        raise ValueError(f"checkpoint {resolved}: {err}") from err
    except Exception as err:  # noqa: BLE001 - unreadable files of any kind get the same actionable message
        raise ValueError(f"checkpoint {resolved} is corrupt or unreadable ({type(err).__name__}: {err})") from err
    if kernel_backend is not None:
        cfg.moe.kernel_backend = kernel_backend
    model = _build(cfg, torch.device(device))
    try:
        if state is None:
            _load_dcp(resolved, model)
        else:
            _load_state(model, state)
    except (Exception, _CheckpointException) as err:  # noqa: BLE001 - DCP's exception is a BaseException
        raise ValueError(f"checkpoint {resolved} is corrupt or does not match its config ({err}); "
                         f"point at another checkpoint") from err
    return LoadedModel(model.eval(), cfg, tokenizer, resolved, step)


def resolve_checkpoint(path: Path) -> Path:
    """The file or directory to read: a run / checkpoints directory resolves to its newest complete step."""
    if path.is_file():
        if path.suffix not in (".safetensors", ".pt"):
            raise ValueError(f"checkpoint {path}: single-file checkpoints are .safetensors or .pt")
        return path
    if (path / "meta.json").is_file() or (path / "config.json").is_file():
        return path
    for root in (path, path / "checkpoints"):
        steps = complete_checkpoints(root)
        if steps:
            return steps[-1]
    hint = " (an incomplete save: no meta.json)" if STEP_DIR.match(path.name.removesuffix(".tmp")) else ""
    raise ValueError(f"checkpoint {path} is not a checkpoint{hint}: expected a step_XXXXXXXX directory with "
                     f"meta.json, a run directory holding checkpoints/, a .safetensors/.pt file, or a "
                     f"Hugging Face directory with config.json")


def save_model_file(path: str | Path, model: Transformer, tokenizer: str | None = "byte") -> Path:
    """Write weights + config as one .safetensors or .pt file that `load_model` reads back."""
    path = Path(path)
    if path.suffix not in (".safetensors", ".pt"):
        raise ValueError(f"{path}: the file name must end in .safetensors or .pt")
    config_yaml = OmegaConf.to_yaml({"model": OmegaConf.structured(model.cfg), "data": {"tokenizer": tokenizer}})
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path), metadata={_CONFIG_KEY: config_yaml})
    else:
        torch.save({"model": state, _CONFIG_KEY: config_yaml}, path)
    return path


# --------------------------------------------------------------------------- helpers


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (step_XXXXXXXX with meta.json) under root, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / f).is_file() for f in _TOKENIZER_FILES)


def _parse_config(raw, origin: str) -> tuple[ModelConfig, str | None]:
    """ModelConfig + data.tokenizer of a (possibly partial) run config; only the model section is required."""
    if not isinstance(raw, dict) or "model" not in raw:
        raise ValueError(f"{origin} has no `model:` section")
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), raw["model"])
    tokenizer = (raw.get("data") or {}).get("tokenizer", "byte")
    return OmegaConf.to_object(merged), tokenizer


def _read_config_yaml(path: Path) -> tuple[ModelConfig, str | None]:
    if not path.is_file():
        raise ValueError(f"{path.name} is missing; it holds the model config the weights belong to")
    return _parse_config(OmegaConf.to_container(OmegaConf.load(path), resolve=True), path.name)


def _read_file(path: Path) -> tuple[ModelConfig, str | None, dict[str, Tensor]]:
    """Single-file checkpoint: config from the file itself, else from a config.yaml beside it."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as f:
            embedded = (f.metadata() or {}).get(_CONFIG_KEY)
        state = load_file(str(path))
    else:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        embedded = blob.get(_CONFIG_KEY) if isinstance(blob, dict) and "model" in blob else None
        state = blob["model"] if embedded is not None else blob
    if embedded is not None:
        cfg, tokenizer = _parse_config(OmegaConf.to_container(OmegaConf.create(embedded), resolve=True), path.name)
    else:
        cfg, tokenizer = _read_config_yaml(path.parent / "config.yaml")
    return cfg, tokenizer, state


def _build(cfg: ModelConfig, device: torch.device) -> Transformer:
    """The model with uninitialised storage on `device` (weights are loaded next), rotary tables filled."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.rotary.reset_buffers()
    return model


def _load_state(model: Transformer, state: dict[str, Tensor]) -> None:
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"missing weights {missing[:5]}, unexpected weights {unexpected[:5]}")
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, the config implies {tuple(expected[name].shape)}")
    model.load_state_dict(state, strict=True)


def _load_dcp(path: Path, model: Transformer) -> None:
    """Read only the model entries of a DCP checkpoint (no process group needed), in place."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    saved = {k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")}
    state = model.state_dict()
    missing = sorted(set(state) - saved)
    if missing:
        raise ValueError(f"missing weights {missing[:5]}")
    with warnings.catch_warnings():  # single-process loading is the intent here, not an accident
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=str(path), no_dist=not dist.is_initialized())
