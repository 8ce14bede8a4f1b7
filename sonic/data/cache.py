"""Build-once cache entries that concurrent processes (the ranks of a torchrun job) share safely.

An entry is a directory. It is built under a temporary name and published by one atomic rename,
with a manifest.json, written last, that lists every file's size and sha256. `ensure` checks
an entry against its manifest each time and rebuilds one that does not match (a partial copy,
a disk error, a hand edit). Builders of one entry take turns on an flock, so ranks that start
together build it once and the others wait, then reuse it. The flock needs a filesystem that
honours it (local disks do; some NFS set-ups do not: there, point the cache at a local disk).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_BLOCK = 1 << 24


def digest(value) -> str:
    """sha256 of a JSON-serialisable value (its canonical JSON): the key of a cache entry."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def check(directory: Path) -> tuple[dict | None, str]:
    """(manifest, "") when every file the manifest lists is there with its size and sha256, else (None, why)."""
    path = directory / MANIFEST
    if not directory.is_dir():
        return None, "missing"
    if not path.is_file():
        return None, "no manifest.json (a build that did not finish)"
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        return None, f"unreadable manifest.json ({error})"
    for name, meta in files.items():
        file = directory / name
        if not file.is_file():
            return None, f"{name} is missing"
        if file.stat().st_size != meta["bytes"]:
            return None, f"{name} is {file.stat().st_size} bytes, the manifest says {meta['bytes']}"
        if file_sha256(file) != meta["sha256"]:
            return None, f"{name} does not match its sha256"
    return manifest, ""


def _write_manifest(directory: Path, info: dict) -> dict:
    files = {str(f.relative_to(directory)): {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
             for f in sorted(directory.rglob("*")) if f.is_file()}
    manifest = {**info, "files": files}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, directory / MANIFEST)
    return manifest


@contextlib.contextmanager
def _locked(path: Path, what: str):
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish building %s (%s)", what, path.parent)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure(directory: str | os.PathLike, build: Callable[[Path], dict], what: str) -> dict:
    """The manifest of the entry at `directory`, built first by `build(tmp_dir) -> info` when missing or
    broken. `info` (JSON) is kept in the manifest beside the file list."""
    directory = Path(directory)
    manifest, _ = check(directory)
    if manifest is not None:
        return manifest
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _locked(directory.with_name(directory.name + ".lock"), what):
        manifest, problem = check(directory)
        if manifest is not None:  # another process built it while this one waited
            return manifest
        if directory.exists():
            log.warning("cache entry %s (%s) is broken: %s; rebuilding it", directory, what, problem)
            shutil.rmtree(directory)
        prefix = f"{directory.name}.tmp-{socket.gethostname()}-"
        for stale in directory.parent.glob(prefix + "*"):  # this host's builds that died
            pid = stale.name.removeprefix(prefix)
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = directory.with_name(prefix + str(os.getpid()))
        tmp.mkdir()
        start = time.perf_counter()
        try:
            info = build(tmp)
            manifest = _write_manifest(tmp, {**info, "build_seconds": round(time.perf_counter() - start, 1)})
            os.replace(tmp, directory)
        except OSError:
            # Without a working flock (some NFS) another host may have published first: keep its entry.
            manifest, _ = check(directory)
            shutil.rmtree(tmp, ignore_errors=True)
            if manifest is None:
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return manifest


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
