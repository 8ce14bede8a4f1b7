"""Data configuration (a Hydra structured config; `configs/data/*.yaml` merge into it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from sonic.data import local_bpe
from sonic.data.tokenizer import DEFAULT_CACHE_DIR

SOURCES = ("embedded", "hf", "files", "shards", "local_text")
TXT_DOCS = ("paragraph", "line", "file")


@dataclass
class DataConfig:
    # embedded (ships with the package) | hf (datasets by name) | files | shards (prepared) |
    # local_text (this machine's Python sources and docs, sonic/data/local_text.py; tokenised once, cached)
    source: str = "embedded"
    name: Optional[str] = None  # hf: dataset name, e.g. HuggingFaceTB/smollm-corpus
    subset: Optional[str] = None  # hf: dataset config, e.g. fineweb-edu-dedup
    split: str = "train"  # hf: split that training (and, without val_split, validation) reads
    val_split: Optional[str] = None  # hf: separate held-out split; unset = hold val_docs out of `split`
    streaming: bool = False  # hf / files: read documents lazily (no full download or up-front tokenisation)
    paths: list[str] = field(default_factory=list)  # files: files or globs (jsonl, json, parquet, txt); shards: directories
    weights: Optional[list[float]] = None  # mixture weights, one per entry of `paths` (token shares); unset = natural sizes
    text_column: str = "text"  # field holding the document text (jsonl, json, parquet, hf)
    txt_docs: str = "paragraph"  # how a .txt file splits into documents: paragraph (blank lines) | line | file
    # byte (offline, 259 ids) | local_bpe:<V> (BPE with V tokens trained offline on the local text corpus)
    # | any transformers tokenizer name or local path
    tokenizer: str = "byte"
    val_docs: int = 64  # documents held out for validation (never trained on)
    num_workers: int = 0  # dataloader worker processes per rank (0 = in the training process)
    cache_dir: str = DEFAULT_CACHE_DIR  # built once, reused: local_text corpus + shards, local_bpe tokenizers

    def __post_init__(self):
        def bad(field_name, value, fix):
            raise ValueError(f"data.{field_name}={value!r}: {fix}")

        if self.source not in SOURCES:
            bad("source", self.source, f"use one of {', '.join(SOURCES)}")
        if self.source == "hf" and not self.name:
            bad("name", self.name, "source: hf needs a dataset name, e.g. name: HuggingFaceTB/smollm-corpus")
        if self.source in ("files", "shards") and not self.paths:
            what = "files or globs (jsonl, json, parquet, txt)" if self.source == "files" else "prepared shard directories"
            bad("paths", self.paths, f"source: {self.source} needs paths: a list of {what}")
        if self.source in ("embedded", "hf", "local_text") and self.paths:
            bad("paths", self.paths, f"source: {self.source} reads no paths; remove them or use source: files")
        if self.weights is not None:
            if len(self.weights) != len(self.paths):
                bad("weights", self.weights, f"give one weight per entry of paths ({len(self.paths)}), or leave it unset")
            if any(w <= 0 for w in self.weights):
                bad("weights", self.weights, "mixture weights must all be > 0 (drop a path instead of weighting it 0)")
            if self.streaming:
                bad("weights", self.weights, "mixtures need streaming: false (or prepare shards per component)")
        if self.streaming and self.source not in ("hf", "files"):
            bad("streaming", self.streaming, "only source: hf or files can stream; set streaming: false")
        if self.val_split is not None and self.source != "hf":
            bad("val_split", self.val_split, "only source: hf has named splits; use val_docs instead")
        if self.txt_docs not in TXT_DOCS:
            bad("txt_docs", self.txt_docs, f"use one of {', '.join(TXT_DOCS)}")
        if not self.text_column:
            bad("text_column", self.text_column, "name the column that holds the text, e.g. text")
        if not self.tokenizer:
            bad("tokenizer", self.tokenizer, "use byte (offline), local_bpe:<vocab size> or a transformers "
                "tokenizer name or local path")
        local_bpe.parse(self.tokenizer)  # a malformed local_bpe:<V> raises, naming data.tokenizer
        if not self.cache_dir:
            bad("cache_dir", self.cache_dir, "name a writable directory, e.g. ~/.cache/sonic")
        if self.val_docs < 1:
            bad("val_docs", self.val_docs, "hold out at least 1 document for validation")
        if self.num_workers < 0:
            bad("num_workers", self.num_workers, "use 0 (load in the training process) or a positive worker count")
