"""Load a Sonic model (weights + ModelConfig + tokenizer name) from whatever a user points at.

Accepted paths, so eval and export take the same argument:
  a checkpoint directory step_XXXXXXXX (DCP shards, config.yaml, meta.json; see sonic/train/checkpoint.py)
  a run directory or a checkpoints directory: its newest complete checkpoint
  a single file model.safetensors / model.pt written by `save_model_file`
  a Hugging Face OLMoE / Qwen3-MoE directory (config.json + safetensors), converted by sonic.models.hf
The checkpoint layout is defined here (models stays below train, which writes it), and so is how
it is read safely: every file is checked against meta.json's SHA-256 before anything is loaded,
and loading runs no code from the files (see `read_dcp`; .pt files load with weights_only=True).
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import json
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from sonic.models.config import ModelConfig
from sonic.models.transformer import Transformer

STEP_DIR = re.compile(r"^step_(\d{8})$")  # the checkpoint layout, shared with sonic/train/checkpoint.py
_CONFIG_KEY = "sonic_config"  # safetensors metadata / .pt key holding the config YAML
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_CHUNK = 8 << 20  # bytes read at a time while hashing


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
    if (resolved / "meta.json").is_file():  # a DCP checkpoint: check every file before reading any
        problems = checkpoint_problems(resolved)
        if problems:
            raise ValueError(f"checkpoint {resolved} is corrupt ({'; '.join(problems)}); point at another checkpoint")
        if problems is None:
            warnings.warn(f"checkpoint {resolved} lists no checksums (written by an older Sonic): not verified")
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
        unsafe = find_cause(err, pickle.UnpicklingError)
        if unsafe is not None:
            raise ValueError(f"checkpoint {resolved} {UNTRUSTED} ({str(unsafe).splitlines()[0]})") from err
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


# --------------------------------------------------------------------------- integrity


def sha256(path: Path) -> str:
    """SHA-256 of a file, streamed. Why SHA-256 rather than a CRC: OpenSSL's SHA-256 uses the
    CPU's SHA extensions and here hashes ~0.7 GB/s, faster than zlib.crc32 (~0.3 GB/s), releases
    the GIL, catches any truncation or flipped bit, and `sha256sum` checks a file by hand."""
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """What meta.json records of a file: its size and SHA-256."""
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def _file_problem(path: Path, expected: dict[str, Any]) -> str | None:
    try:
        if not path.is_file():
            return f"{path.name} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{path.name} has {size} bytes, meta.json says {expected['bytes']} (truncated or partial)"
        if sha256(path) != expected["sha256"]:
            return f"{path.name} does not match its SHA-256 in meta.json"
    except (OSError, KeyError, TypeError) as err:  # an unreadable file, a malformed entry
        return f"{path.name} cannot be checked ({type(err).__name__}: {err})"
    return None


def checkpoint_problems(path: Path, select: Callable[[str], bool] = lambda name: True) -> list[str] | None:
    """What is wrong with the files of checkpoint directory `path` that `select` picks, checked
    against meta.json ([]: intact); None for a checkpoint written before meta.json listed checksums."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        files = meta.get("files", {})
        if not isinstance(meta.get("step"), int) or not isinstance(files, dict):
            raise ValueError("no step number or file list")
    except (OSError, ValueError, AttributeError) as err:  # AttributeError: JSON that is not an object
        return [f"meta.json is unreadable ({type(err).__name__}: {err})"]
    if "files" not in meta:
        return None
    return [problem for name in sorted(files) if select(name)
            if (problem := _file_problem(path / name, files[name])) is not None]


# DCP's .metadata is a pickle, and DCP loads its non-tensor items (the optimizer's hyperparameters)
# with torch.load(weights_only=False): as DCP reads them, a planted file runs code. Sonic reads both
# without running any: .metadata through an unpickler that builds DCP's metadata dataclasses and
# nothing else, the byte items with weights_only=True. (Tensors DCP already loads weights_only.)
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
_PATHS = {(module, name) for module in ("pathlib", "pathlib._local")
          for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (module, name) in _PATHS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _METADATA_MODULES:  # imports nothing else
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """FileSystemReader whose read_metadata unpickles DCP's metadata classes only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(self.path) / name, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{name} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor items only if they are tensors and plain values."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # raises on anything else, before DCP's own torch.load
        value.seek(0)
        super().load_bytes(read_item, value)


UNTRUSTED = ("holds more than tensors and plain values, so it was not loaded: loading it could run code. Load "
             "checkpoints only from places you trust")


def find_cause(err: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The `kind` exception behind `err`, looking through causes, contexts and DCP's
    CheckpointException (its `failures`: rank -> error or (error, traceback))."""
    todo, seen = [err], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        for f in (getattr(e, "failures", None) or {}).values():
            todo.append(f[0] if isinstance(f, tuple) else f)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def read_dcp(state: dict[str, Any], path: Path, **kwargs) -> None:
    """dcp.load(state) from checkpoint directory `path`, in place, running no code from its files."""
    import torch.distributed.checkpoint as dcp

    reader = SafeReader(str(path))
    reader.read_metadata()  # once here too: inside dcp.load, its UnpicklingError would become a message string
    dcp.load(state, storage_reader=reader, planner=SafePlanner(), **kwargs)


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

    metadata = SafeReader(str(path)).read_metadata()
    saved = {k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")}
    state = model.state_dict()
    missing = sorted(set(state) - saved)
    if missing:
        raise ValueError(f"missing weights {missing[:5]}")
    with warnings.catch_warnings():  # single-process loading is the intent here, not an accident
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        read_dcp({"model": state}, path, no_dist=not dist.is_initialized())
