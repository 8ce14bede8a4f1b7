"""Local file sources (jsonl, json, parquet, txt, globs), mixtures, HF `datasets` on local data, streaming."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from sonic.data import DataConfig, build_loaders, build_tokenizer
from sonic.data.documents import iter_documents
from tests.data.conftest import same_batches, take, word_docs, write_jsonl

S, B = 16, 2


def texts(cfg) -> list[str]:
    return [t for _, t in iter_documents(cfg)]


def test_file_types_and_globs(tmp_path):
    docs = [f"document {i} says hello" for i in range(6)]
    write_jsonl(tmp_path / "a.jsonl", docs[:2])
    (tmp_path / "b.json").write_text(json.dumps([{"text": d} for d in docs[2:4]]))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": docs[4:], "id": [4, 5]}), tmp_path / "c.parquet", row_group_size=1)
    cfg = DataConfig(source="files", paths=[str(tmp_path / "*")], val_docs=1)
    assert texts(cfg) == docs
    assert texts(DataConfig(source="files", paths=[str(tmp_path)], val_docs=1)) == docs  # a directory's files
    columnar = tmp_path / "cols" / "d.json"
    columnar.parent.mkdir()
    columnar.write_text(json.dumps({"body": docs}))
    assert texts(DataConfig(source="files", paths=[str(columnar)], text_column="body")) == docs


def test_txt_document_splitting(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("first doc\nline two\n\n  \nsecond doc\n\n\nthird\n")
    cfg = DataConfig(source="files", paths=[str(path)])
    assert texts(cfg) == ["first doc\nline two", "second doc", "third"]
    cfg.txt_docs = "line"
    assert texts(cfg) == ["first doc", "line two", "", "  ", "second doc", "", "", "third"]
    cfg.txt_docs = "file"
    assert texts(cfg) == [path.read_text()]


def test_loaders_over_each_file_type(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = [f"record number {i}: " + "abc " * (i % 7) for i in range(40)]
    write_jsonl(tmp_path / "d.jsonl", docs)
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet")
    (tmp_path / "d.txt").write_text("\n\n".join(docs))
    got = []
    for name in ("d.jsonl", "d.parquet", "d.txt"):
        cfg = DataConfig(source="files", paths=[str(tmp_path / name)], val_docs=4)
        train, val = build_loaders(cfg, tokenizer=build_tokenizer(cfg), seq_len=S, micro_batch_size=B, seed=5)
        got.append((take(train, 3), list(val)))
    assert all(same_batches(got[0][0], g[0]) and same_batches(got[0][1], g[1]) for g in got[1:])


def test_mixture_weights_set_token_shares(tmp_path, word_tokenizer_dir):
    a = write_jsonl(tmp_path / "a.jsonl", word_docs(200, seed=1, prefix="a"))
    b = write_jsonl(tmp_path / "b.jsonl", word_docs(200, seed=2, prefix="b"))
    for weights, share in (([3.0, 1.0], 0.75), ([1.0, 4.0], 0.2), (None, 0.5)):
        cfg = DataConfig(source="files", paths=[a, b], weights=weights, tokenizer=word_tokenizer_dir, val_docs=4)
        tok = build_tokenizer(cfg)
        train, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, seed=0)
        rows = [[tok.hf.convert_ids_to_tokens(t)[0] for t in row.tolist() if t != tok.eos_token_id]
                for batch in take(train, 600) for row in batch["input_ids"]]
        words = Counter(w for row in rows for w in row)
        assert words["a"] / (words["a"] + words["b"]) == pytest.approx(share, abs=0.04), weights
        assert sum(set(r) == {"a", "b"} for r in rows) > 0.1 * len(rows), "components interleave within sequences"


def test_hf_dataset_by_local_name(tmp_path, monkeypatch):
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "my_dataset"
    root.mkdir()
    write_jsonl(root / "train.jsonl", [f"train doc {i}." for i in range(50)])
    write_jsonl(root / "validation.jsonl", [f"valid doc {i}" for i in range(5)])
    cfg = DataConfig(source="hf", name=str(root), val_split="validation", val_docs=3)
    tok = build_tokenizer(cfg)
    train, val = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B)
    assert "train doc" in tok.decode(next(train)["input_ids"].flatten())
    val_text = "".join(tok.decode(b["input_ids"][b["labels"] != -100]) for b in val)
    assert "valid doc 2" in val_text and "valid doc 3" not in val_text and "train" not in val_text
    cfg.streaming = True
    train, val = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B)
    assert "train doc" in tok.decode(next(train)["input_ids"].flatten())


@pytest.fixture
def stream_files(tmp_path, word_tokenizer_dir):
    docs = word_docs(240)
    paths = [write_jsonl(tmp_path / f"part{i}.jsonl", docs[i::4]) for i in range(4)]
    return DataConfig(source="files", paths=paths, streaming=True, tokenizer=word_tokenizer_dir, val_docs=10), docs


def test_streaming_ranks_disjoint_and_validation_held_out(stream_files):
    cfg, docs = stream_files
    tok = build_tokenizer(cfg)
    for world in (2, 3, 5):  # 4 files: whole files per rank (2, 3: unevenly) or every 5th document (5)
        seen, held = [], set()
        for rank in range(world):
            train, val = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=rank, world_size=world)
            seen.append({t for b in take(train, 12) for t in b["input_ids"].flatten().tolist()} - {tok.eos_token_id})
            held |= {t for b in val for t in b["input_ids"][b["labels"] != -100].tolist()} - {tok.eos_token_id}
        assert all(seen) and not any(seen[i] & seen[j] for i in range(world) for j in range(i))
        assert held == {t for d in docs[0:40:4][:10] for t in tok.encode(d)}, "the stream's first documents"
        assert not held & set().union(*seen)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_streaming_resume(stream_files, num_workers):
    cfg, _ = stream_files
    cfg.num_workers = num_workers
    tok = build_tokenizer(cfg)
    train, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=1, world_size=2)
    before = take(train, 136)
    if num_workers == 0:  # one stream: consecutive windows overlap by the one label token
        rows = [row for b in before for row in zip(b["input_ids"], b["labels"])]
        assert all((y[:-1] == x[1:]).all() and y[-1] == nx[0] for (x, y), (nx, _) in zip(rows, rows[1:]))
    state = train.state_dict()
    assert all(s["epoch"] == 1 for s in state["streams"]), "resumes inside the second pass over the files"
    expected = take(train, 6)
    resumed, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert same_batches(take(resumed, 2), expected[:2])
    again, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=1, world_size=2)
    again.load_state_dict(resumed.state_dict())  # a resume saved soon after a resume
    assert same_batches(take(again, 4), expected[2:])
    with pytest.raises(ValueError, match="rank"):
        build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=0, world_size=2)[0].load_state_dict(state)
