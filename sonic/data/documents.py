"""Where documents come from: the embedded corpus, local files, the local text corpus, or HF `datasets`.

Everything here yields raw text in a fixed order; tokenising, splitting and packing happen later,
so on-the-fly loading and `prepare` see the same document sequence.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Iterator

from sonic.data.local_text import embedded_path, ensure_corpus

FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_PARAGRAPH_BREAK = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")  # one or more blank lines


def expand(pattern: str) -> list[str]:
    """Files matched by one `paths` entry (a file, a directory's files, or a glob), sorted for a fixed order."""
    pattern = os.path.expanduser(pattern)
    if os.path.isdir(pattern):
        files = [os.path.join(pattern, f) for f in os.listdir(pattern)]
        files = [f for f in files if os.path.splitext(f)[1] in FILE_KINDS]
    else:
        files = glob.glob(pattern, recursive=True)
    files = sorted(f for f in files if os.path.isfile(f))
    if not files:
        raise ValueError(f"data.paths entry {pattern!r} matches no file; check the path or glob (cwd: {os.getcwd()})")
    for f in files:
        if os.path.splitext(f)[1] not in FILE_KINDS:
            raise ValueError(f"{f}: unsupported file type; data.paths takes {', '.join(FILE_KINDS)} files")
    return files


def components(cfg) -> list[list[str]]:
    """One file list per mixture component (per `paths` entry, or all of them as one when unweighted)."""
    if cfg.source == "embedded":
        return [[embedded_path()]]
    if cfg.source == "local_text":  # built on first use
        return [[str(ensure_corpus(cfg.cache_dir)[0])]]
    assert cfg.source == "files", cfg.source
    groups = [expand(p) for p in cfg.paths]
    return groups if cfg.weights is not None else [[f for g in groups for f in g]]


def file_docs(path: str, text_column: str, txt_docs: str) -> Iterator[str]:
    """Documents of one local file, in file order (None counts as an empty document)."""
    kind = os.path.splitext(path)[1]
    if kind == ".txt":
        yield from _txt_docs(path, txt_docs)
    elif kind == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    yield _text_of(_parse_json(line, f"{path}:{line_no}"), text_column, f"{path}:{line_no}")
    elif kind == ".json":
        with open(path, encoding="utf-8") as f:
            data = _parse_json(f.read(), path)
        if isinstance(data, dict) and isinstance(data.get(text_column), list):
            data = [{text_column: t} for t in data[text_column]]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a list of records or {{{text_column!r}: [...]}}; "
                             "write one JSON object per line as .jsonl instead")
        for i, record in enumerate(data):
            yield _text_of(record, text_column, f"{path}[{i}]")
    elif kind == ".parquet":
        yield from _parquet_docs(path, text_column)
    else:
        raise ValueError(f"{path}: unsupported file type; data.paths takes {', '.join(FILE_KINDS)} files")


def _txt_docs(path: str, txt_docs: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        if txt_docs == "line":
            for line in f:
                yield line.rstrip("\n")
            return
        text = f.read()
    if txt_docs == "file":
        yield text
    else:
        yield from (p.strip("\n") for p in _PARAGRAPH_BREAK.split(text))


def _parse_json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: invalid JSON ({error}); fix or remove the record") from error


def _text_of(record, text_column: str, where: str) -> str:
    if not isinstance(record, dict) or text_column not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: no text column {text_column!r} (found {keys}); set data.text_column")
    text = record[text_column]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{where}: column {text_column!r} holds {type(text).__name__}, not text; "
                         "set data.text_column to a string column")
    return text or ""


def _parquet_docs(path: str, text_column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises several types for unreadable files
        raise ValueError(f"{path}: not a readable parquet file ({error})") from error
    if text_column not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no text column {text_column!r} (found {pf.schema_arrow.names}); "
                         "set data.text_column")
    for group in range(pf.num_row_groups):
        for text in pf.read_row_group(group, columns=[text_column]).column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{path}: column {text_column!r} is not text; set data.text_column")
            yield text or ""


def iter_documents(cfg) -> Iterator[tuple[int, str]]:
    """(component, text) for every document of a non-streaming embedded / files / hf source, in order."""
    if cfg.source == "hf":
        for text in open_hf(cfg, cfg.split, streaming=False).texts():
            yield 0, text
        return
    txt_docs = "paragraph" if cfg.source == "embedded" else cfg.txt_docs
    text_column = "text" if cfg.source == "local_text" else cfg.text_column
    for c, files in enumerate(components(cfg)):
        for path in files:
            for text in file_docs(path, text_column, txt_docs):
                yield c, text


def source_label(cfg, component: int = 0) -> str:
    """Names a source in error messages."""
    if cfg.source == "hf":
        return _hf_label(cfg, cfg.split)
    if cfg.source == "shards":
        return cfg.paths[component]
    if cfg.source == "local_text":
        return f"the local text corpus (in {cfg.cache_dir}/local_text)"
    files = components(cfg)[component]
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


class HFSource:
    """A `datasets` Dataset / IterableDataset plus the column that holds its text and a label for errors."""

    def __init__(self, ds, column: str, label: str):
        self.ds, self.column, self.label = ds, column, label
        if ds.column_names is not None and column not in ds.column_names:
            raise ValueError(f"{label}: no text column {column!r} (found {ds.column_names}); set data.text_column")

    def texts(self, batch_size: int = 1000) -> Iterator[str]:
        for batch in self.ds.iter(batch_size=batch_size):
            yield from self.batch_texts(batch)

    def batch_texts(self, batch: dict) -> list[str]:
        if self.column not in batch:
            raise ValueError(f"{self.label}: no text column {self.column!r} (found {sorted(batch)}); "
                             "set data.text_column")
        return [t or "" for t in batch[self.column]]


def open_hf(cfg, split: str, streaming: bool) -> HFSource:
    """A hf source by name, or local files read through `datasets` (how files stream)."""
    import datasets

    if cfg.source == "files":
        files = [f for group in components(cfg) for f in group]
        kinds = {FILE_KINDS[os.path.splitext(f)[1]] for f in files}
        if len(kinds) != 1:
            raise ValueError(f"data.paths mixes file types {sorted(kinds)}; streaming reads one type "
                             "(or set streaming: false)")
        kind = kinds.pop()
        options = {"sample_by": {"paragraph": "paragraph", "line": "line", "file": "document"}[cfg.txt_docs]} \
            if kind == "text" else {}
        ds = datasets.load_dataset(kind, data_files=files, split="train", streaming=streaming, **options)
        return HFSource(ds, "text" if kind == "text" else cfg.text_column, source_label(cfg))
    label = _hf_label(cfg, split)
    try:
        ds = datasets.load_dataset(cfg.name, cfg.subset, split=split, streaming=streaming)
    except Exception as error:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError, ...)
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"{label} could not be loaded ({reason}); check data.name / subset / split, "
                         "or use source: files or embedded offline") from error
    return HFSource(ds, cfg.text_column, label)


def _hf_label(cfg, split: str) -> str:
    return f"HF dataset {cfg.name!r}" + (f" ({cfg.subset})" if cfg.subset else "") + f" split {split!r}"
