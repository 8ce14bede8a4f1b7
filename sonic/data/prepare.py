"""Tokenise a corpus once, in parallel, into memory-mapped shards that `source: shards` reads
(`ensure_shards`: the local text corpus's, built once per tokenizer and cached, for `source: local_text`).

    python -m sonic.data.prepare OUT_DIR --config configs/data/fineweb_edu.yaml [--procs 16] \
        [--shard-tokens 100000000] [--max-docs N] [key=value ...]
    python -m sonic.data.prepare --verify OUT_DIR

Resumable: finished shards stay, and a rerun with the same arguments continues after the last one.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import io
import itertools
import logging
import multiprocessing as mp
import os
import sys
from pathlib import Path

import numpy as np

from sonic.data import cache, documents, shards
from sonic.data.config import DataConfig
from sonic.data.corpus import tokenize_chunk
from sonic.data.local_text import ensure_corpus
from sonic.data.tokenizer import build_tokenizer, load_tokenizer, token_dtype, tokenizer_digest

log = logging.getLogger(__name__)

SOURCE_KEYS = ("source", "name", "subset", "split", "paths", "text_column", "txt_docs", "tokenizer")
# cache_dir is left out: it says where local_text / local_bpe are cached, not what they hold

_worker_tokenizer = []  # one per pool process, set by its initializer (a pool task has no other channel)


def _init_worker(name: str, cache_dir: str) -> None:
    _worker_tokenizer.append(load_tokenizer(name, cache_dir))


def _tokenize(tokenizer, task):
    texts, position = task
    tokens, lengths, empty = tokenize_chunk(tokenizer, texts, token_dtype(tokenizer.vocab_size))
    return tokens, lengths, empty, len(texts), position


def _tokenize_in_worker(task):
    return _tokenize(_worker_tokenizer[0], task)


def _bounded_imap(pool, tasks, depth: int):
    """Ordered results with at most `depth` chunks in flight: Pool.imap would read the whole corpus ahead."""
    pending = collections.deque()
    for task in tasks:
        pending.append(pool.apply_async(_tokenize_in_worker, (task,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _chunks(cfg, index: dict, max_docs: int | None, chunk_docs: int):
    """(texts, position after them) from where the index stopped; a position resumes the source exactly."""
    done = index["docs_read"]
    limit = None if max_docs is None else max(0, max_docs - done)
    if cfg.source == "hf" and cfg.streaming:
        source = documents.open_hf(cfg, cfg.split, streaming=True)
        if index["resume"] is not None:
            source.ds.load_state_dict(index["resume"])
        for batch in source.ds.iter(batch_size=chunk_docs):
            texts = source.batch_texts(batch)[:limit]
            done += len(texts)
            yield texts, {"docs_read": done, "resume": source.ds.state_dict()}
            if limit is not None:
                limit -= len(texts)
                if limit == 0:
                    return
        return
    texts = (text for _, text in documents.iter_documents(cfg))
    texts = itertools.islice(texts, done, None if max_docs is None else max_docs)
    while chunk := list(itertools.islice(texts, chunk_docs)):
        done += len(chunk)
        yield chunk, {"docs_read": done, "resume": None}


class _ShardWriter:
    """Appends documents to the open shard and publishes it (tmp + rename, then index) when full."""

    def __init__(self, directory: str, index: dict):
        self.directory, self.index = directory, index
        self.dtype = np.dtype(index["dtype"])
        self._open()

    def _open(self):
        self.number = len(self.index["shards"])
        self.path = os.path.join(self.directory, shards.shard_names(self.number)[0])
        self.file = open(self.path + ".tmp", "wb")
        self.hash = hashlib.blake2b(digest_size=16)
        self.lengths, self.tokens = [], 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray):
        data = tokens.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.lengths.append(lengths)
        self.tokens += len(tokens)

    def publish(self, position: dict, empty: int, complete: bool = False):
        """Makes the open shard durable and records it, with the source position right after it."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.tokens:
            os.replace(self.path + ".tmp", self.path)
            ends_name = shards.shard_names(self.number)[1]
            buffer = io.BytesIO()
            np.save(buffer, np.cumsum(np.concatenate(self.lengths)).astype(np.int64))
            shards.atomic_write(os.path.join(self.directory, ends_name), buffer.getvalue())
            self.index["shards"].append({
                "file": os.path.basename(self.path), "tokens": self.tokens, "docs": int(sum(map(len, self.lengths))),
                "bytes": self.tokens * self.dtype.itemsize, "blake2b": self.hash.hexdigest(),
                "ends": ends_name, "ends_bytes": len(buffer.getvalue())})
        else:
            os.remove(self.path + ".tmp")
        self.index.update(position, complete=complete)
        self.index["empty_docs"] += empty
        shards.write_index(self.directory, self.index)
        if not complete:
            self._open()


def _start_index(out: str, cfg: DataConfig, tokenizer) -> dict:
    """The existing index to resume (same source and tokenizer only) or a fresh one."""
    source = {k: getattr(cfg, k) for k in SOURCE_KEYS}
    source["paths"] = list(source["paths"])
    if os.path.exists(os.path.join(out, shards.INDEX)):
        index = shards.read_index(out)
        if index["source"] != source:
            raise ValueError(f"{out} already holds shards of another source ({index['source']}); "
                             "prepare into a fresh directory, or rerun with the same config to resume")
        return index
    return {"format": shards.FORMAT, "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
            "eos_token_id": tokenizer.eos_token_id, "dtype": token_dtype(tokenizer.vocab_size).name,
            "source": source, "complete": False, "docs_read": 0, "resume": None, "empty_docs": 0, "shards": []}


def prepare(cfg: DataConfig, out: str, procs: int = 0, shard_tokens: int = 100_000_000,
            max_docs: int | None = None, chunk_docs: int = 256, progress: bool = True, tokenizer=None) -> dict:
    """Tokenises `cfg`'s documents into shards under `out`; returns the final index. `tokenizer`: the one
    `cfg.tokenizer` names, when the caller has it loaded already.

    Shards close at the first chunk boundary past `shard_tokens`, so a shard's end is always a
    resumable source position.
    """
    from tqdm import tqdm

    if cfg.source == "shards":
        raise ValueError("data.source=shards is already prepared; prepare reads embedded, files or hf")
    if cfg.weights is not None:
        raise ValueError("data.weights: prepare one shard directory per component, then list the directories "
                         "in paths (source: shards) with the weights")
    if shard_tokens < 1 or chunk_docs < 1:
        raise ValueError(f"shard_tokens={shard_tokens} and chunk_docs={chunk_docs} must be >= 1")
    tokenizer = tokenizer or build_tokenizer(cfg)
    os.makedirs(out, exist_ok=True)
    index = _start_index(out, cfg, tokenizer)
    if index["complete"]:
        return index
    writer = _ShardWriter(out, index)
    bar = tqdm(desc=f"prepare {out}", unit=" docs", initial=index["docs_read"], disable=not progress)
    pool = mp.get_context().Pool(procs, _init_worker, (cfg.tokenizer, cfg.cache_dir)) if procs > 0 else None
    tasks = _chunks(cfg, index, max_docs, chunk_docs)
    results = _bounded_imap(pool, tasks, 4 * procs) if pool else (_tokenize(tokenizer, t) for t in tasks)
    empty, position = 0, {"docs_read": index["docs_read"], "resume": index["resume"]}
    done_tokens = sum(s["tokens"] for s in index["shards"])
    try:
        for tokens, lengths, n_empty, n_read, position in results:
            writer.add(tokens, lengths)
            empty += n_empty
            bar.update(n_read)
            bar.set_postfix(shards=len(index["shards"]), tokens=f"{done_tokens + writer.tokens:,}")
            if writer.tokens >= shard_tokens:
                done_tokens += writer.tokens
                writer.publish(position, empty)
                empty = 0
        if not index["shards"] and not writer.tokens:
            raise ValueError(f"{documents.source_label(cfg)}: no non-empty documents; the dataset is empty")
        writer.publish(position, empty, complete=True)
    finally:
        bar.close()
        if pool:
            pool.terminate()
    return index


def ensure_shards(cfg, tokenizer) -> Path:
    """The local text corpus tokenised by `tokenizer` into prepared shards (`prepare`), built
    once per (corpus, tokenizer) so that the ranks of a job memory-map one copy instead of each
    tokenising ~128 MiB at start-up."""
    corpus_path, corpus = ensure_corpus(cfg.cache_dir)
    key = cache.digest({"corpus_sha256": corpus["sha256"], "tokenizer": tokenizer_digest(tokenizer)})
    entry = Path(cfg.cache_dir).expanduser() / "local_shards" / key[:16]

    def build(tmp: Path) -> dict:
        log.info("tokenising the local text corpus (%.1f MiB) with %s into %s", corpus["bytes"] / 2**20,
                 tokenizer.name, entry)
        files_cfg = DataConfig(source="files", paths=[str(corpus_path)], tokenizer=cfg.tokenizer,
                               cache_dir=cfg.cache_dir)
        # procs=0: the fast tokenizer's own threads encode each chunk (no forked pool inside a training rank)
        index = prepare(files_cfg, str(tmp), procs=0, chunk_docs=1024, progress=False, tokenizer=tokenizer)
        tokens = sum(s["tokens"] for s in index["shards"])
        log.info("local text corpus: %d tokens (%.2f bytes per token)", tokens, corpus["bytes"] / tokens)
        return {"corpus_sha256": corpus["sha256"], "tokenizer": tokenizer.name, "tokens": tokens}

    cache.ensure(entry, build, f"the local text corpus tokenised by {tokenizer.name}")
    return entry


def _config(config_path: str | None, overrides: list[str]) -> DataConfig:
    from omegaconf import OmegaConf

    merged = OmegaConf.structured(DataConfig)
    if config_path:
        merged = OmegaConf.merge(merged, OmegaConf.load(config_path))
    return OmegaConf.to_object(OmegaConf.merge(merged, OmegaConf.from_dotlist(overrides)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sonic.data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output directory (resumed when it holds an unfinished prepare)")
    parser.add_argument("overrides", nargs="*", help="DataConfig overrides, e.g. tokenizer=gpt2 paths=[a.jsonl]")
    parser.add_argument("--config", help="a configs/data/*.yaml file")
    parser.add_argument("--procs", type=int, default=os.cpu_count(), help="tokenizer processes (0: in-process)")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (at least)")
    parser.add_argument("--max-docs", type=int, help="stop after this many source documents")
    parser.add_argument("--chunk-docs", type=int, default=256, help="documents per tokenizer task")
    parser.add_argument("--verify", action="store_true", help="check OUT's shard hashes instead of preparing")
    args = parser.parse_intermixed_args(argv)
    if args.verify:
        print(f"{args.out}: {shards.verify(args.out):,} tokens, all shards match index.json")
        return
    index = prepare(_config(args.config, args.overrides), args.out, args.procs, args.shard_tokens, args.max_docs,
                    args.chunk_docs)
    tokens = sum(s["tokens"] for s in index["shards"])
    docs = sum(s["docs"] for s in index["shards"])
    print(f"{args.out}: {len(index['shards'])} shards, {docs:,} documents, {tokens:,} tokens "
          f"({index['empty_docs']} empty documents skipped), dtype {index['dtype']}")


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        sys.exit(f"error: {error}")
