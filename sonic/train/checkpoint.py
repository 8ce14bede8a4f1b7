"""Checkpoints that are atomic and resume bit-exactly, single process or FSDP-2.

Layout of one checkpoint, <dir>/step_00000100/:
  .metadata, *.distcp   model + optimizer (torch.distributed.checkpoint: any world size)
  extra_rank<r>.pt      data-loader position, RNG states, skip counts and model buffers of rank r,
                        as tensors and plain values only
  config.yaml           the resolved run config (eval and HF export read it)
  meta.json             written last; its presence marks the checkpoint complete. It holds the
                        step, the world size and the size and SHA-256 of every other file
Everything is written into step_XXXXXXXX.tmp and renamed once complete, so a crash
mid-save never leaves a directory that `resume: auto` would pick. A save that fails on any rank
(e.g. a full disk) fails on every rank, removes its .tmp directory and leaves older checkpoints
intact. Non-finite weights are never saved (the trainer also checks their loss first, see
trainer.py), and retention keeps the checkpoint the trainer names (the newest before a run of
skipped steps).

Before a resume the files are checked against meta.json (collectively: every rank hashes a
share and all see every result). `resume: auto` sets a corrupt or partial checkpoint aside as
step_XXXXXXXX.corrupt and takes the next older one; an explicit path stops with a ValueError.
Loading runs no code from the files: extra_rank<r>.pt loads with weights_only=True, and DCP's
.metadata (a pickle) and its non-tensor items through sonic.models.loading.read_dcp. meta.json
guards against corruption, not against someone who rewrites it: load checkpoints from trusted places.

Buffers (e.g. the router's balance residual) may differ between ranks, while DCP keeps one
copy of an unsharded tensor; each rank therefore also keeps its own in extra_rank<r>.pt and
gets it back on a resume at the same world size (another world size takes DCP's copy).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import re
import shutil
import socket
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from sonic import compat
from sonic.models.loading import (UNTRUSTED, checkpoint_problems, complete_checkpoints, file_entry, find_cause,
                                  read_dcp)
from sonic.train.optim import TritonAdamW

log = logging.getLogger("sonic")
# which rank wrote a file: DCP names its files __<rank>_<n>.distcp; ours are extra_rank<r>.pt
_WRITER = re.compile(r"^(?:__(\d+)_\d+\.distcp|extra_rank(\d+)\.pt)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, on every rank (a collective)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _raise_failures(failures: list[tuple[int | None, str] | None], what: str) -> None:
    """Raise on this rank if any rank failed; `failures` holds every rank's (errno, description) or None.
    Called with all ranks' failures on every rank, so all raise together and none waits on the others."""
    failed = [(rank, f) for rank, f in enumerate(failures) if f]
    if failed:
        text = f"{what}: " + "; ".join(f"rank {rank}: {desc}" if len(failures) > 1 else desc
                                       for rank, (_, desc) in failed)
        codes = [code for _, (code, _) in failed if code]
        raise OSError(codes[0], text) if codes else RuntimeError(text)


def _writer_rank(name: str) -> int:
    """The rank that wrote (and, at save, hashes) a checkpoint file; 0 for shared files."""
    m = _WRITER.match(name)
    return int(m.group(1) or m.group(2)) if m else 0


def verify(path: Path) -> str | None:
    """What is wrong with checkpoint `path` (None: intact); the same answer on every rank.

    A collective: each rank hashes every world-th file (by writer rank), then all ranks see all
    results. A checkpoint written before meta.json listed its files is not checked."""
    problems = checkpoint_problems(path, select=lambda name: _writer_rank(name) % _world() == _rank())
    if problems is None and _rank() == 0:
        log.warning("checkpoint %s lists no checksums (written by an older Sonic): not verified", path)
    problems = sorted({p for ps in _all_gather(problems or []) for p in ps})
    return "; ".join(problems) or None


def set_aside(path: Path) -> Path:
    """Rename a corrupt checkpoint to <name>.corrupt (kept for inspection; nothing reads it)."""
    target, n = path.with_name(path.name + ".corrupt"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt{n}")
    path.rename(target)
    return target


def all_finite(tensors) -> bool:
    """True if every element of `tensors` is finite on every rank (DTensors: their local shards)."""
    local = [t.detach().to_local() if hasattr(t, "to_local") else t.detach() for t in tensors]
    assert local, "no tensors to check"
    bad = torch.zeros(1, device=local[0].device)
    nonempty = [t for t in local if t.numel()]
    if nonempty:  # max |x|: propagates NaN and, unlike a 2-norm, cannot overflow on finite values
        bad += (~torch.stack(compat.foreach_max_abs(nonempty)).isfinite()).any()
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bad.item()


def _os_error(err: BaseException) -> OSError | None:
    return find_cause(err, OSError)


def _failure(err: BaseException | None) -> tuple[int | None, str] | None:
    """(errno, description) of a failed write, to share with the other ranks."""
    if err is None:
        return None
    os_err = _os_error(err)
    if os_err is not None and os_err.errno == errno.ENOSPC:
        return os_err.errno, "no space left on device"
    return (os_err.errno if os_err else None), f"{type(os_err or err).__name__}: {os_err or err}"


def unwritable(directory: Path) -> str | None:
    """Why `directory` cannot be created or written to (None: it can), tried with a probe file.
    Named per process, not per rank: Hydra's callback runs check_run_dir before
    init_process_group, when every rank is rank 0, and two ranks sharing one probe could delete
    each other's."""
    probe = directory / f".write_test.{socket.gethostname()}.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"sonic")
        probe.unlink()
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


def check_run_dir(run_dir: Path) -> None:
    """Fail at start-up, on every rank, if `run_dir` cannot be created or written."""
    failures = [(r, f) for r, f in enumerate(_all_gather(unwritable(run_dir))) if f]
    if failures:
        where = "; ".join(f"rank {r}: {f}" if _world() > 1 else f for r, f in failures)
        raise ValueError(f"train.run_dir={str(run_dir)!r} cannot be written ({where}); set train.run_dir to a "
                         f"writable directory with free space (checkpoints, metrics.jsonl and logs go there)")


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain values (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    if isinstance(n, dict):
        n = (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    np.random.set_state(n)  # a tuple with a numpy array in checkpoints of an older Sonic
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_array_globals() -> list:
    """What a pickled numpy array references (older checkpoints held numpy's RNG state as one):
    constructors of arrays and dtypes only, which weights_only=True may then build."""
    core = getattr(np, "_core", None) or np.core
    return [np.ndarray, np.dtype, type(np.dtype(np.uint32)), core.multiarray._reconstruct]


def plain(obj: Any, where: str = "state") -> Any:
    """`obj` as tensors and plain values (dict, list, tuple, str, int, float, bool, None), what
    torch.load(weights_only=True) reads back: numpy scalars become Python numbers and numpy arrays
    tensors; anything else is an error now, at the save, rather than at the resume."""
    if obj is None or isinstance(obj, (str, bool, int, float, torch.Tensor)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, dict):
        return {plain(k, where): plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):  # a namedtuple becomes a tuple
        return (list if isinstance(obj, list) else tuple)(plain(v, f"{where}[{i}]") for i, v in enumerate(obj))
    raise TypeError(f"{where} is a {type(obj).__name__}: a checkpoint holds only tensors and plain values")


def clean_name(name: str) -> str:
    """Parameter/buffer name without activation-checkpoint or compile wrapper prefixes."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[clean_name(f"{prefix}.{name}" if prefix else name)] = buf
    return out


def state_dicts(model, optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's (model, optimizer) state dicts, with fp32 weights standing for the bf16 ones of one GPU (`TritonAdamW`'s
    `fp32_weights`: its masters, left out of the optimizer's state, or without masters fp32 copies): a save writes
    what fp32 weights would, and a load reads the weights into those in place (then set_state_dict rounds them
    into the parameters). A checkpoint moves between the ways of holding the weights unchanged."""
    msd, osd = get_state_dict(model, optimizer)
    fp32 = optimizer.fp32_weights() if isinstance(optimizer, TritonAdamW) else {}
    if not fp32:
        return msd, osd
    named = {clean_name(name): p for name, p in model.named_parameters()}
    assert set(named) <= set(msd), sorted(set(named) - set(msd))[:3]
    msd = {**msd, **{name: fp32[p] for name, p in named.items() if p in fp32}}
    osd = {**osd, "state": {k: {key: v for key, v in st.items() if key != "master"} for k, st in osd["state"].items()}}
    return msd, osd


class Checkpointer:
    def __init__(self, root: str | Path, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, model, optimizer, extra: dict[str, Any], config_yaml: str,
             keep: Path | None = None) -> Path:
        """Write checkpoint `step`; then delete all but the newest train.keep_last, and `keep`."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        if not all_finite(model.parameters()):
            raise FloatingPointError(f"the weights hold non-finite values at step {step} (a finite gradient can "
                                     f"still overflow them, e.g. at a very high optim.lr); not saving, so "
                                     f"{self.root} keeps only intact checkpoints. Lower optim.lr and resume "
                                     f"from the newest one (train.resume=auto)")
        try:
            self._write(step, tmp, final, model, optimizer, plain(extra, "extra"), config_yaml, keep)
        except (Exception, dcp.api.CheckpointException) as err:  # noqa: BLE001 - DCP's is a BaseException
            _barrier()  # every rank has left _write: the .tmp directory is no longer written to
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            os_err = _os_error(err)
            if os_err is None:
                raise
            raise OSError(os_err.errno, f"{_failure(os_err)[1]} while saving checkpoint {final.name} under "
                                        f"{self.root}; its partial {tmp.name} was removed and the older checkpoints "
                                        f"are intact. Free space or move train.run_dir to a larger disk, then "
                                        f"resume (train.resume=auto)") from err
        return final

    def _write(self, step: int, tmp: Path, final: Path, model, optimizer, extra: dict[str, Any],
               config_yaml: str, keep: Path | None) -> None:
        """Write the checkpoint into `tmp`, then rename it to `final`. Each phase ends in a collective
        after which every rank raises if any rank failed (DCP's own save already fails together)."""
        error = None
        if _rank() == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except Exception as err:  # noqa: BLE001 - shared with the other ranks, raised below
                error = err
        _raise_failures(_all_gather(_failure(error)), f"creating {tmp.name}")

        msd, osd = state_dicts(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
        buffers = {k: v.detach().cpu() for k, v in persistent_buffers(model).items()}
        error, hashes = None, {}
        try:
            torch.save({**extra, "rng": rng_state(), "buffers": buffers}, tmp / f"extra_rank{_rank()}.pt")
        except Exception as err:  # noqa: BLE001
            error = err
        _barrier()  # on every rank, failed or not: all files are written (DCP's .metadata by rank 0 too)
        try:
            for f in sorted(tmp.iterdir()) if error is None else []:  # each rank hashes what it wrote,
                if _writer_rank(f.name) == _rank():  # while it is still in its page cache
                    hashes[f.name] = file_entry(f)
        except Exception as err:  # noqa: BLE001
            error = err
        gathered = _all_gather((_failure(error), hashes))
        _raise_failures([failure for failure, _ in gathered], f"writing {tmp.name}")

        error = None
        if _rank() == 0:
            try:
                files = {name: h for _, hs in gathered for name, h in hs.items()}
                (tmp / "config.yaml").write_text(config_yaml)
                files["config.yaml"] = file_entry(tmp / "config.yaml")
                meta = {"step": step, "world_size": _world(), "files": dict(sorted(files.items()))}
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
                if final.exists():  # an older save of the same step (e.g. after a rollback)
                    shutil.rmtree(final)
                os.replace(tmp, final)
                for old in complete_checkpoints(self.root)[:-self.keep_last] if self.keep_last > 0 else []:
                    if old != keep:
                        shutil.rmtree(old, ignore_errors=True)
            except Exception as err:  # noqa: BLE001
                error = err
        _raise_failures(_all_gather(_failure(error)), f"finishing {final.name}")

    def find(self, resume: str) -> Path | None:
        """Checkpoint to resume from: 'none', 'auto' (the newest intact one, if any) or a path.

        A collective (the files are verified, see `verify`): call it on every rank."""
        if resume == "none":
            return None
        if resume == "auto":
            candidates = _all_gather(complete_checkpoints(self.root))[0]  # rank 0's listing, for all ranks
            for path in reversed(candidates):
                problem = verify(path)  # returns on a rank once all ranks have read `path`
                if problem is None:
                    return path
                if _rank() == 0:  # renamed once
                    log.warning("checkpoint %s is corrupt (%s); set aside as %s, trying an older one", path,
                                problem, set_aside(path).name)
            if candidates and _rank() == 0:
                log.warning("no intact checkpoint left in %s: training starts from step 0", self.root)
            return None
        path = Path(resume)
        if not (path / "meta.json").is_file():
            raise ValueError(f"train.resume={resume!r} is not a complete checkpoint directory (no meta.json); "
                             f"point it at a step_XXXXXXXX directory, or use train.resume=auto|none")
        problem = verify(path)
        if problem is not None:
            raise ValueError(f"checkpoint {path} is corrupt ({problem}); point train.resume at another checkpoint, "
                             f"or use train.resume=auto, which sets corrupt checkpoints aside and resumes from the "
                             f"newest intact one")
        return path

    def load(self, path: Path, model, optimizer) -> dict[str, Any]:
        """Restore model and optimizer in place; return this rank's extra state (RNG applied)."""
        try:
            meta = json.loads((path / "meta.json").read_text())
            msd, osd = state_dicts(model, optimizer)
            state = {"model": msd, "optim": osd}
            read_dcp(state, path)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        except (Exception, dcp.api.CheckpointException) as err:  # noqa: BLE001 - DCP's is a BaseException
            unsafe = find_cause(err, pickle.UnpicklingError)
            if unsafe is not None:
                raise ValueError(f"checkpoint {path} {UNTRUSTED} ({str(unsafe).splitlines()[0]})") from err
            raise ValueError(f"checkpoint {path} does not match this model and optimizer, or is corrupt ({err}); "
                             f"resume with the config it was saved with (its config.yaml), point train.resume at "
                             f"another checkpoint, or set train.resume=none") from err
        same_world = meta["world_size"] == _world()
        extra_file = path / f"extra_rank{_rank() if same_world else 0}.pt"
        try:
            with torch.serialization.safe_globals(_numpy_array_globals()):  # an older Sonic's numpy RNG state
                extra = torch.load(extra_file, weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(f"checkpoint {path}: {extra_file.name} {UNTRUSTED} "
                             f"({str(err).splitlines()[0]})") from err
        if same_world:
            set_rng_state(extra["rng"])
            buffers = persistent_buffers(model)
            with torch.no_grad():
                for name, saved in extra.get("buffers", {}).items():
                    buffers[name].copy_(saved)
        else:
            warnings.warn(f"resuming a {meta['world_size']}-rank checkpoint on {_world()} ranks: model and optimizer "
                          f"are restored; the data order and RNG restart from the seed")
            extra.pop("loader", None)
        extra["step"] = meta["step"]
        return extra
