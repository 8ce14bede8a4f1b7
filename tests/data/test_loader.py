"""Packing, rank sharding, epochs, resume and validation of the indexed (non-streaming) loader."""
from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest
import torch

from sonic.data import DataConfig, build_loaders, build_tokenizer
from sonic.data.packing import doc_ids_from_eos, make_batch
from tests.data.conftest import same_batches, take, word_docs, write_jsonl

S, B = 16, 2


def windows_of(batches_by_rank: list[list[dict]], world: int, limit: int) -> list[dict]:
    """Rows with global window index < limit, over ranks (window g = (step * world + rank) * B + b)."""
    rows = []
    for rank, batches in enumerate(batches_by_rank):
        for step, batch in enumerate(batches):
            for b in range(B):
                if (step * world + rank) * B + b < limit:
                    rows.append({k: v[b] for k, v in batch.items()})
    return rows


def val_ids(val) -> Counter:
    return Counter(t for batch in val for row, lab in zip(batch["input_ids"], batch["labels"])
                   for t in row[lab != -100].tolist())


def test_batch_layout(word_corpus):
    cfg, tok, _ = word_corpus
    train, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, seed=0)
    for batch in take(train, 20):
        x, y, d = batch["input_ids"], batch["labels"], batch["doc_ids"]
        assert x.shape == y.shape == d.shape == (B, S) and x.dtype == y.dtype == d.dtype == torch.long
        assert (y[:, :-1] == x[:, 1:]).all(), "labels are the next tokens"
        eos = x == tok.eos_token_id
        eos[:, 0] = False
        assert (d == eos.long().cumsum(1)).all(), "each EOS opens the next document"
        assert (d[:, 0] == 0).all()


def test_doc_ids_and_padding():
    assert doc_ids_from_eos(8, np.array([0, 3, 7, 8])).tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    window = (np.arange(9), np.array([2]))
    batch = make_batch([window, window], 8, valid=[8, 5])
    assert batch["labels"][0].tolist() == list(range(1, 9))
    assert batch["labels"][1].tolist() == [1, 2, 3, 4, 5, -100, -100, -100]
    assert batch["doc_ids"][1].tolist() == [0, 0, 1, 1, 1, 2, 2, 2], "padding is its own document"


def test_epoch_covers_every_token_once_across_ranks(word_corpus):
    cfg, tok, docs = word_corpus
    world = 2
    loaders = [build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=r, world_size=world, seed=3)
               for r in range(world)]
    held = val_ids(loaders[0][1]) + val_ids(loaders[1][1])
    all_words = Counter(t for d in docs for t in tok.encode(d))
    train_words = all_words - Counter({t: 1 for t in held if t != tok.eos_token_id})
    assert sum(train_words.values()) + sum(v for t, v in held.items() if t != tok.eos_token_id) == \
        sum(all_words.values()), "validation words come from held-out documents only"
    epoch_tokens = sum(train_words.values()) + len(docs) - cfg.val_docs  # + one EOS per training document
    n_windows = (epoch_tokens - 1) // S
    steps = -(-n_windows // (world * B))
    rows = windows_of([take(train, steps) for train, _ in loaders], world, n_windows)
    seen = Counter(t for row in rows for t in row["input_ids"].tolist())
    words_seen = Counter({t: c for t, c in seen.items() if t != tok.eos_token_id})
    assert max(words_seen.values()) == 1, "a token repeated within one epoch"
    assert not set(words_seen) & set(held), "training saw a validation token"
    missing = sum((train_words - words_seen).values()) + (len(docs) - cfg.val_docs - seen[tok.eos_token_id])
    assert 0 <= missing < S, "only the epoch's last partial window may be left out"
    # next epoch: same documents, new order
    more = windows_of([take(train, steps) for train, _ in loaders], world, n_windows)
    assert [r["input_ids"].tolist() for r in more[:4]] != [r["input_ids"].tolist() for r in rows[:4]]


def test_ranks_disjoint(word_corpus):
    cfg, tok, _ = word_corpus
    seen = []
    for rank in range(2):
        train, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=rank, world_size=2)
        seen.append({t for b in take(train, 10) for t in b["input_ids"].flatten().tolist()} - {tok.eos_token_id})
    assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_long_documents_split_and_empty_documents_skipped(tmp_path, word_tokenizer_dir):
    docs = word_docs(30, max_words=8) + [" ".join(f"a{i}" for i in range(5 * S))]
    texts = [docs[0], "", "   \n", *docs[1:], ""]
    cfg = DataConfig(source="files", paths=[write_jsonl(tmp_path / "d.jsonl", texts)],
                     tokenizer=word_tokenizer_dir, val_docs=1)
    tok = build_tokenizer(cfg)
    train, val = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B)
    plan = train.streams.plan
    assert plan.corpus.empty_docs == 3 and plan.corpus.n_docs == len(docs)
    long_ids = set(tok.encode(docs[-1]))
    assert not long_ids & set(val_ids(val)), "the long document is a training document here"
    ids = [set(b["input_ids"].flatten().tolist()) & long_ids for b in take(train, 40)]
    assert sum(bool(s) for s in ids) >= 5 and set().union(*ids) == long_ids


def test_resume_gives_the_next_batch(word_corpus):
    cfg, tok, _ = word_corpus
    train, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=1, world_size=2, seed=7)
    take(train, 150)  # crosses into the second epoch
    state = pickle.loads(pickle.dumps(train.state_dict()))
    assert len(pickle.dumps(state)) < 2000
    expected = take(train, 5)
    resumed, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=1, world_size=2, seed=7)
    resumed.load_state_dict(state)
    assert same_batches(take(resumed, 5), expected)


def test_workers_give_the_same_stream_and_resume(word_corpus):
    cfg, tok, _ = word_corpus
    reference, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, seed=1)
    expected = take(reference, 9)
    cfg.num_workers = 2
    train, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, seed=1)
    assert same_batches(take(train, 5), expected[:5])
    state = train.state_dict()  # 5 consumed: the next batch comes from the second worker's stream
    resumed, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, seed=1)
    resumed.load_state_dict(state)
    assert same_batches(take(resumed, 4), expected[5:])


def test_seed_changes_order_and_mismatched_state_is_refused(word_corpus):
    cfg, tok, _ = word_corpus
    a, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, seed=0)
    b, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, seed=0)
    c, _ = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, seed=1)
    first = take(a, 3)
    assert same_batches(first, take(b, 3)) and not same_batches(first, take(c, 3))
    other, _ = build_loaders(cfg, tokenizer=tok, seq_len=2 * S, micro_batch_size=B, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        other.load_state_dict(a.state_dict())


def test_validation_is_fixed_finite_and_covers_held_out_tokens_once(word_corpus):
    cfg, tok, docs = word_corpus
    vals = [build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=r, world_size=2, seed=r)[1]
            for r in range(2)]
    assert len(vals[0]) == len(vals[1]) == len(list(vals[0]))
    assert same_batches(list(vals[0]), list(vals[0]))
    targets = Counter(t for v in vals for batch in v for t in batch["labels"][batch["labels"] != -100].tolist())
    inputs = val_ids(vals[0]) + val_ids(vals[1])
    held = [d for d in docs if tok.encode(d)[0] in inputs]
    assert len(held) == cfg.val_docs
    stream = [t for d in held for t in tok.encode(d) + [tok.eos_token_id]]
    assert targets == Counter(stream[1:]) and inputs == Counter(stream[:-1])
    assert sum(targets.values()) == vals[0].tokens
    assert all((b["labels"] != -100).any() for v in vals for b in v), "no rank gets a batch without targets"


def test_bad_arguments(word_corpus):
    cfg, tok, _ = word_corpus
    with pytest.raises(ValueError, match="rank"):
        build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seq_len"):
        build_loaders(cfg, tokenizer=tok, seq_len=10**6, micro_batch_size=B)
    cfg.val_docs = 300
    with pytest.raises(ValueError, match="val_docs"):
        build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B)
