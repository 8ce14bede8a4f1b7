"""Offline text that every machine has: the embedded corpus the package ships (`embedded_path`), and
this Python installation's sources and docs, as documents.

GPU machines cannot reach the Hub, so the large presets need data that is already on disk. Two corpora
come from here, one document per file:

- `build_code_corpus`: the stdlib's and site-packages' *.py files (the reduced token-rounding run).
- `ensure_corpus`: the *local text corpus* of `source: local_text` and of the `local_bpe` tokenizer,
  code mixed with natural language (package READMEs and METADATA, *.md / *.rst / *.txt docs,
  /usr/share/doc, the embedded corpus), capped at CORPUS_BYTES and cached under data.cache_dir.

Both are deterministic for one installation; a different installation gives a different corpus, so
its sha256 is recorded (and keys every cache entry built from it).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import random
import re
import sys
import sysconfig
import zlib
from importlib import resources
from pathlib import Path
from typing import Iterable, Iterator

from sonic.data import cache

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the selection, order or filters below change: cached corpora then rebuild
CORPUS_BYTES = 128 << 20  # tokenizer training text and training documents (see docs/data.md for the timings)
PROSE_SHARE = 1 / 3  # of the bytes, while natural-language files last; code fills the rest
MAX_FILE_BYTES = 1 << 20  # larger files are mostly generated tables, not text
MIN_LETTER_SHARE = 0.7  # prose files below it are data (number tables, test vectors)
SYSTEM_DOCS = Path("/usr/share/doc")
PROSE_SUFFIXES = (".md", ".rst", ".txt")
_DOC_NAMES = re.compile(r"(readme|changelog|changes|news|history|authors|thanks|faq|copyright)", re.IGNORECASE)


def embedded_path() -> str:
    """The corpus shipped inside the package (`source: embedded`; `python -m sonic.data.make_corpus` writes it)."""
    return str(resources.files("sonic.data") / "corpus" / "embedded.txt")


def python_roots() -> list[Path]:
    """The standard library and site-packages directories of this interpreter."""
    return sorted({Path(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib", "platlib")})


def python_sources() -> list[Path]:
    """Every .py file of this interpreter's standard library and site-packages, sorted."""
    return sorted({f for root in python_roots() if root.is_dir() for f in root.rglob("*.py") if f.is_file()})


def prose_sources() -> list[Path]:
    """Natural-language files: docs shipped with Python packages (*.md, *.rst, *.txt, dist-info METADATA),
    /usr/share/doc's READMEs, changelogs and text files (gzipped or not), and the embedded corpus."""
    found = set()
    for root in [*python_roots(), SYSTEM_DOCS]:
        for directory, _, names in os.walk(root):
            for name in names:
                base = name.removesuffix(".gz") if root == SYSTEM_DOCS else name
                if (base.lower().endswith(PROSE_SUFFIXES) or (name == "METADATA" and directory.endswith(".dist-info"))
                        or (root == SYSTEM_DOCS and _DOC_NAMES.match(base))):
                    found.add(Path(directory, name))
    return sorted(f for f in found if f.is_file()) + [Path(embedded_path())]


def build_code_corpus(path: Path, max_bytes: int, seed: int = 0) -> dict:
    """The reduced run's data: this interpreter's Python sources, one document per file, in a seeded
    order, up to max_bytes. Real text that a 0.5B model cannot exhaust in minutes, with no network."""
    files = python_sources()
    random.Random(seed).shuffle(files)
    digest, docs, size = hashlib.sha256(), 0, 0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for file in files:
            if size >= max_bytes:
                break
            try:
                text = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # a few sources are Latin-1 or unreadable: skipped, the rest is plenty
            if text.strip():
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                digest.update(line.encode())
                docs, size = docs + 1, size + len(text.encode())
    tmp.replace(path)
    return {"documents": docs, "bytes": size, "sha256": digest.hexdigest(), "seed": seed,
            "python": sys.version.split()[0], "files_available": len(files)}


def _read_text(path: Path) -> str | None:
    """A file's UTF-8 text (gunzipped if .gz), or None when it is too large or not UTF-8 text."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path) as f:
                data = f.read(MAX_FILE_BYTES + 1)
        else:
            if path.stat().st_size > MAX_FILE_BYTES:
                return None
            data = path.read_bytes()
        return None if len(data) > MAX_FILE_BYTES else data.decode("utf-8")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError):  # unreadable, truncated .gz, not UTF-8
        return None


def _is_prose(text: str) -> bool:
    return sum(c.isalpha() or c.isspace() for c in text) >= MIN_LETTER_SHARE * len(text)


def _texts(files: list[Path], prose: bool, seen: set[bytes]) -> Iterator[str]:
    """Usable texts of `files` in order: readable, non-empty, prose-like if `prose`, not seen before."""
    for file in files:
        text = _read_text(file)
        if text is None or not text.strip() or (prose and not _is_prose(text)):
            continue
        key = hashlib.sha256(text.encode()).digest()
        if key not in seen:  # licences and vendored modules repeat across packages
            seen.add(key)
            yield text


def local_documents(code: list[Path], prose: list[Path], max_bytes: int = CORPUS_BYTES,
                    prose_share: float = PROSE_SHARE, seed: int = 0) -> Iterator[tuple[str, str]]:
    """(kind, text) documents, one per file, each kind in a seeded order, interleaved so that prose holds
    `prose_share` of the bytes of every prefix while it lasts; stops once max_bytes are out."""
    assert 0 < prose_share < 1, prose_share
    rng, seen = random.Random(seed), set()
    code, prose = list(code), list(prose)
    rng.shuffle(code)
    rng.shuffle(prose)
    streams = {"prose": _texts(prose, True, seen), "code": _texts(code, False, seen)}
    share = {"prose": prose_share, "code": 1 - prose_share}
    taken, total = {"prose": 0, "code": 0}, 0
    while total < max_bytes and streams:
        kind = min(streams, key=lambda k: taken[k] / share[k])  # the kind furthest below its share
        text = next(streams[kind], None)
        if text is None:
            del streams[kind]
            continue
        yield kind, text
        n = len(text.encode())
        taken[kind], total = taken[kind] + n, total + n


def write_jsonl(path: Path, documents: Iterable[tuple[str, str]]) -> dict:
    """One {"text": ...} line per document (what `source: files` reads); returns counts and the sha256."""
    digest, docs, by_kind = hashlib.sha256(), 0, {}
    with open(path, "wb") as f:
        for kind, text in documents:
            line = (json.dumps({"text": text}) + "\n").encode()
            f.write(line)
            digest.update(line)
            docs += 1
            by_kind[kind] = by_kind.get(kind, 0) + len(text.encode())
    return {"documents": docs, "bytes": sum(by_kind.values()), "bytes_by_kind": by_kind, "sha256": digest.hexdigest()}


def read_jsonl_texts(path: str | os.PathLike) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


CORPUS_FILE = "corpus.jsonl"


def ensure_corpus(cache_dir: str, max_bytes: int = CORPUS_BYTES) -> tuple[Path, dict]:
    """(path of corpus.jsonl, its manifest) for this installation, built once per cache directory.

    The entry is keyed by every candidate file's path, size and mtime, so installing or upgrading a
    package builds a new corpus (and so a new tokenizer); listing them takes a second or two.
    """
    code, prose = python_sources(), prose_sources()
    listing = [(str(f), *_size_mtime(f)) for f in code + prose]
    key = cache.digest({"format": FORMAT, "max_bytes": max_bytes, "prose_share": PROSE_SHARE,
                        "max_file_bytes": MAX_FILE_BYTES, "code": listing[:len(code)], "prose": listing[len(code):]})
    entry = Path(cache_dir).expanduser() / "local_text" / key[:16]

    def build(tmp: Path) -> dict:
        log.info("building the local text corpus (%d code and %d prose files to choose from, up to %d MiB) in %s",
                 len(code), len(prose), max_bytes >> 20, entry)
        info = write_jsonl(tmp / CORPUS_FILE, local_documents(code, prose, max_bytes))
        if info["documents"] == 0:
            raise ValueError(f"the local text corpus is empty: no readable UTF-8 .py, .md, .rst or .txt file under "
                             f"{', '.join(map(str, python_roots()))} or {SYSTEM_DOCS}; use data=embedded, or "
                             "source: files with your own text")
        log.info("local text corpus: %d documents, %.1f MiB (%s), sha256 %s", info["documents"],
                 info["bytes"] / 2**20, ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in info["bytes_by_kind"].items()),
                 info["sha256"])
        return {**info, "python": sys.version.split()[0], "max_bytes": max_bytes,
                "files_available": {"code": len(code), "prose": len(prose)}}

    manifest = cache.ensure(entry, build, "the local text corpus")
    return entry / CORPUS_FILE, manifest


def _size_mtime(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns
