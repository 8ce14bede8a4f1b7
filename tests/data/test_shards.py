"""`python -m sonic.data.prepare` and `source: shards`: identical batches, resumable prepare, corruption checks."""
from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import numpy as np
import pytest

from sonic.data import DataConfig, build_loaders, build_tokenizer, prepare as prepare_module
from sonic.data import shards
from sonic.data.prepare import prepare
from tests.data.conftest import same_batches, take, word_docs, write_jsonl

S, B = 16, 2
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "data"


@pytest.fixture
def files_cfg(tmp_path, word_tokenizer_dir):
    docs = word_docs(400)
    docs[7] = docs[50] = ""  # empty documents are skipped, and counted
    return DataConfig(source="files", paths=[write_jsonl(tmp_path / "docs.jsonl", docs)],
                      tokenizer=word_tokenizer_dir, val_docs=16)


def shards_cfg(cfg, directory) -> DataConfig:
    return DataConfig(source="shards", paths=[str(directory)], tokenizer=cfg.tokenizer, val_docs=cfg.val_docs)


@pytest.mark.parametrize("procs", [0, 2])
def test_shards_give_the_same_batches_as_on_the_fly(tmp_path, files_cfg, procs):
    index = prepare(files_cfg, str(tmp_path / "out"), procs=procs, shard_tokens=1500, chunk_docs=32, progress=False)
    assert index["complete"] and len(index["shards"]) > 2 and index["empty_docs"] == 2
    assert index["dtype"] == "uint32"  # the word tokenizer has more than 65536 ids
    tok = build_tokenizer(files_cfg)
    fly_train, fly_val = build_loaders(files_cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=1,
                                       world_size=2, seed=4)
    shard_train, shard_val = build_loaders(shards_cfg(files_cfg, tmp_path / "out"), tokenizer=tok, seq_len=S,
                                           micro_batch_size=B, rank=1, world_size=2, seed=4)
    assert same_batches(take(fly_train, 200), take(shard_train, 200))
    assert same_batches(list(fly_val), list(shard_val))
    assert shards.verify(str(tmp_path / "out")) == sum(s["tokens"] for s in index["shards"])


def test_byte_shards_are_uint16_and_the_embedded_corpus_round_trips(tmp_path):
    cfg = DataConfig()
    index = prepare(cfg, str(tmp_path / "emb"), procs=0, shard_tokens=100_000, progress=False)
    assert index["dtype"] == "uint16" and index["tokenizer"] == "byte"
    size = sum(os.path.getsize(tmp_path / "emb" / s["file"]) for s in index["shards"])
    assert size == 2 * sum(s["tokens"] for s in index["shards"])
    tok = build_tokenizer(cfg)
    a = build_loaders(cfg, tokenizer=tok, seq_len=64, micro_batch_size=4, seed=2)[0]
    b = build_loaders(shards_cfg(cfg, tmp_path / "emb"), tokenizer=tok, seq_len=64, micro_batch_size=4, seed=2)[0]
    assert same_batches(take(a, 20), take(b, 20))


def crash_after_two_shards(monkeypatch):
    """Makes prepare die while writing its third shard; returns a function that undoes it."""
    publish = prepare_module._ShardWriter.publish

    def crash(self, *args, **kwargs):
        if len(self.index["shards"]) == 2:
            self.file.write(b"partial")  # a half-written shard, never renamed
            raise KeyboardInterrupt
        publish(self, *args, **kwargs)

    monkeypatch.setattr(prepare_module._ShardWriter, "publish", crash)
    return lambda: monkeypatch.setattr(prepare_module._ShardWriter, "publish", publish)


def test_prepare_resumes_after_the_last_complete_shard(tmp_path, files_cfg, monkeypatch):
    reference = prepare(files_cfg, str(tmp_path / "ref"), procs=0, shard_tokens=1500, chunk_docs=32, progress=False)
    out = str(tmp_path / "out")
    undo = crash_after_two_shards(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        prepare(files_cfg, out, procs=0, shard_tokens=1500, chunk_docs=32, progress=False)
    partial = shards.read_index(out)
    assert not partial["complete"] and len(partial["shards"]) == 2
    first_files = {s["file"]: os.stat(os.path.join(out, s["file"])).st_mtime_ns for s in partial["shards"]}
    with pytest.raises(ValueError, match="has not finished"):
        shards.load([out], build_tokenizer(files_cfg))

    undo()
    tokenized = []
    chunk = prepare_module.tokenize_chunk
    monkeypatch.setattr(prepare_module, "tokenize_chunk", lambda tok, texts, dt: tokenized.append(len(texts))
                        or chunk(tok, texts, dt))
    final = prepare(files_cfg, out, procs=0, shard_tokens=1500, chunk_docs=32, progress=False)
    assert [s["blake2b"] for s in final["shards"]] == [s["blake2b"] for s in reference["shards"]]
    assert final["empty_docs"] == reference["empty_docs"] == 2
    assert sum(tokenized) == 400 - partial["docs_read"], "only the documents after the last shard are redone"
    assert all(os.stat(os.path.join(out, f)).st_mtime_ns == t for f, t in first_files.items())
    other = DataConfig(source="files", paths=files_cfg.paths, tokenizer="byte")
    with pytest.raises(ValueError, match="another source"):
        prepare(other, out, procs=0, progress=False)


def test_prepare_resumes_a_streaming_hf_source_from_its_saved_position(tmp_path, monkeypatch, word_tokenizer_dir):
    root = tmp_path / "local_dataset"
    root.mkdir()
    docs = word_docs(300)
    for i in range(3):
        write_jsonl(root / f"train-{i}.jsonl", docs[i * 100:(i + 1) * 100])
    cfg = DataConfig(source="hf", name=str(root), streaming=True, tokenizer=word_tokenizer_dir)
    options = dict(procs=0, shard_tokens=1000, chunk_docs=16, progress=False)
    reference = prepare(cfg, str(tmp_path / "ref"), **options)
    undo = crash_after_two_shards(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, str(tmp_path / "out"), **options)
    assert shards.read_index(str(tmp_path / "out"))["resume"] is not None
    undo()
    final = prepare(cfg, str(tmp_path / "out"), **options)
    assert [s["blake2b"] for s in final["shards"]] == [s["blake2b"] for s in reference["shards"]]
    assert sum(s["docs"] for s in final["shards"]) == 300


def test_command_line(tmp_path, capsys):
    out = str(tmp_path / "cli")
    prepare_module.main([out, "--config", str(CONFIGS / "embedded.yaml"), "--procs", "2", "--shard-tokens", "50000",
                         "val_docs=8"])
    assert "documents" in capsys.readouterr().out
    index = shards.read_index(out)
    assert index["complete"] and len(index["shards"]) >= 3 and index["source"]["source"] == "embedded"
    prepare_module.main([out, "--verify"])
    assert "all shards match" in capsys.readouterr().out


def test_workers_read_shards_through_memory_maps(tmp_path, files_cfg):
    prepare(files_cfg, str(tmp_path / "out"), procs=0, shard_tokens=1500, chunk_docs=32, progress=False)
    cfg, tok = shards_cfg(files_cfg, tmp_path / "out"), build_tokenizer(files_cfg)
    corpus = shards.load(cfg.paths, tok)
    clone = pickle.loads(pickle.dumps(corpus))
    assert all(isinstance(a, np.memmap) for a in clone.arrays) and (clone.piece(3, 0, 5) == corpus.piece(3, 0, 5)).all()
    serial = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, seed=9)[0]
    cfg.num_workers = 2
    parallel = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, seed=9)[0]
    assert same_batches(take(serial, 6), take(parallel, 6))


def test_corrupt_or_mismatched_shards_are_named(tmp_path, files_cfg):
    out = tmp_path / "out"
    index = prepare(files_cfg, str(out), procs=0, shard_tokens=1500, chunk_docs=32, progress=False)
    tok = build_tokenizer(files_cfg)
    victim = out / index["shards"][1]["file"]
    data = victim.read_bytes()
    victim.write_bytes(data[:-4])
    with pytest.raises(ValueError, match=f"{victim}.*truncated"):
        build_loaders(shards_cfg(files_cfg, out), tokenizer=tok, seq_len=S, micro_batch_size=B)
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    shards.load([str(out)], tok)  # sizes match: loading stays cheap
    with pytest.raises(ValueError, match=f"{victim}.*blake2b"):
        shards.verify(str(out))
    with pytest.raises(ValueError, match="data.tokenizer: "):
        shards.load([str(out)], build_tokenizer(DataConfig()))
    with pytest.raises(ValueError, match="index.json not found"):
        shards.load([str(tmp_path)], tok)


def test_shard_loader_throughput(tmp_path, capsys):
    """Reports tokens/s of the memory-mapped loader (seq_len 2048, batch 8); fails only if absurdly slow."""
    rng = np.random.default_rng(0)
    words = np.array(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"])
    path = tmp_path / "big.jsonl"
    write_jsonl(path, [" ".join(rng.choice(words, size=n)) for n in rng.integers(50, 800, size=3000)])
    cfg = DataConfig(source="files", paths=[str(path)])
    prepare(cfg, str(tmp_path / "big"), procs=0, shard_tokens=2_000_000, progress=False)
    tok = build_tokenizer(cfg)
    train, _ = build_loaders(shards_cfg(cfg, tmp_path / "big"), tokenizer=tok, seq_len=2048, micro_batch_size=8)
    next(train)
    start, tokens = time.perf_counter(), 0
    while time.perf_counter() - start < 1.0:
        tokens += next(train)["input_ids"].numel()
    rate = tokens / (time.perf_counter() - start)
    with capsys.disabled():
        print(f"\nshard loader: {rate / 1e6:.1f}M tokens/s (seq_len 2048, micro-batch 8, 1 process)")
    assert rate > 1e6
