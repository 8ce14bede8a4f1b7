"""Prepared shards: flat token files (uint16 / uint32) plus per-shard document ends, described by index.json.

    DIR/index.json              format, tokenizer, dtype, source config, progress, shard list
    DIR/shard_00000.bin         tokens of whole documents, each followed by EOS
    DIR/shard_00000.ends.npy    int64 cumulative document ends within the shard

Every file is written to a .tmp name and renamed, and index.json lists only finished shards, so
an interrupted `prepare` leaves a valid prefix to resume from.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from sonic.data.corpus import TokenCorpus, open_tokens

FORMAT = "sonic-shards/1"
INDEX = "index.json"
HASH_BLOCK = 1 << 24


def shard_names(i: int) -> tuple[str, str]:
    return f"shard_{i:05d}.bin", f"shard_{i:05d}.ends.npy"


def atomic_write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_index(directory: str, index: dict) -> None:
    atomic_write(os.path.join(directory, INDEX), json.dumps(index, indent=1).encode())


def read_index(directory: str) -> dict:
    path = os.path.join(directory, INDEX)
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found: {directory!r} holds no prepared shards; create them with "
                         f"`python -m sonic.data.prepare {directory} --config <data yaml>`")
    try:
        with open(path) as f:
            index = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); re-run prepare into a fresh directory") from error
    if index.get("format") != FORMAT:
        raise ValueError(f"{path}: format {index.get('format')!r} is not {FORMAT!r}; re-run prepare")
    return index


def file_hash(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def _check_size(path: str, expected: int) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"shard file {path} is missing (listed in index.json); re-run prepare into a fresh directory")
    size = os.path.getsize(path)
    if size != expected:
        raise ValueError(f"shard file {path} is {size} bytes but index.json says {expected}: corrupt or truncated; "
                         "re-run prepare into a fresh directory")


def load(directories: list[str], tokenizer) -> TokenCorpus:
    """Memory-maps prepared shard directories, one mixture component each, after checking them against
    their index (sizes only: `python -m sonic.data.prepare --verify DIR` also checks hashes)."""
    arrays, doc_array, doc_start, doc_len, starts, empty = [], [], [], [], [0], 0
    for directory in directories:
        index = read_index(directory)
        if not index["complete"]:
            raise ValueError(f"{directory}: prepare has not finished ({len(index['shards'])} shards so far); "
                             f"re-run `python -m sonic.data.prepare {directory}` to complete it")
        if (index["vocab_size"], index["eos_token_id"]) != (tokenizer.vocab_size, tokenizer.eos_token_id):
            raise ValueError(f"{directory} was tokenised with {index['tokenizer']!r} (vocab {index['vocab_size']}, "
                             f"eos {index['eos_token_id']}), not data.tokenizer={tokenizer.name!r} (vocab "
                             f"{tokenizer.vocab_size}, eos {tokenizer.eos_token_id}); set data.tokenizer: "
                             f"{index['tokenizer']}")
        dtype = np.dtype(index["dtype"])
        docs_here = 0
        for shard in index["shards"]:
            tokens_path = os.path.join(directory, shard["file"])
            ends_path = os.path.join(directory, shard["ends"])
            _check_size(tokens_path, shard["bytes"])
            _check_size(ends_path, shard["ends_bytes"])
            assert shard["bytes"] == shard["tokens"] * dtype.itemsize
            ends = np.load(ends_path)
            if len(ends) != shard["docs"] or (len(ends) and int(ends[-1]) != shard["tokens"]):
                raise ValueError(f"shard file {ends_path} does not match index.json ({len(ends)} documents); "
                                 "re-run prepare into a fresh directory")
            lengths = np.diff(ends, prepend=0)
            doc_array.append(np.full(len(ends), len(arrays), dtype=np.int32))
            doc_start.append(ends - lengths)
            doc_len.append(lengths)
            arrays.append(open_tokens(tokens_path, dtype, shard["tokens"]))
            docs_here += len(ends)
        if docs_here == 0:
            raise ValueError(f"{directory}: the prepared dataset is empty (0 documents); prepare a non-empty source")
        starts.append(starts[-1] + docs_here)
        empty += index.get("empty_docs", 0)
    return TokenCorpus(arrays=arrays, doc_array=np.concatenate(doc_array), doc_start=np.concatenate(doc_start),
                       doc_len=np.concatenate(doc_len), component_starts=starts,
                       eos_token_id=tokenizer.eos_token_id, empty_docs=empty)


def verify(directory: str) -> int:
    """Checks every shard's size and hash against index.json; returns the token count."""
    index = read_index(directory)
    for shard in index["shards"]:
        path = os.path.join(directory, shard["file"])
        _check_size(path, shard["bytes"])
        if file_hash(path) != shard["blake2b"]:
            raise ValueError(f"shard file {path} does not match its blake2b in index.json: corrupt; "
                             "re-run prepare into a fresh directory")
    return sum(s["tokens"] for s in index["shards"])
