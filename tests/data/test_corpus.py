"""The embedded default corpus: reproducible from its script, small, and learnable."""
from __future__ import annotations

import math
import os
from collections import Counter, defaultdict

from sonic.data import DataConfig, build_loaders, build_tokenizer
from sonic.data.local_text import embedded_path
from sonic.data.make_corpus import generate


def test_shipped_corpus_is_what_the_script_generates():
    with open(embedded_path(), encoding="utf-8") as f:
        assert f.read() == generate(), "run `python -m sonic.data.make_corpus` after changing the generator"
    assert 100_000 < os.path.getsize(embedded_path()) < 400_000


def test_structure_beats_the_unigram_entropy_on_held_out_text():
    """A count-based 4-gram model fit on the training split predicts validation bytes far better than unigram
    statistics: there is structure for a tiny model to learn, and validation follows the same distribution."""
    cfg = DataConfig()
    tok = build_tokenizer(cfg)
    train, val = build_loaders(cfg, tokenizer=tok, seq_len=256, micro_batch_size=16, seed=0)
    plan = train.streams.plan
    stream = plan.epoch_order(0)
    train_ids = [t for d in stream for t in plan.corpus.piece(int(d), 0, int(plan.corpus.doc_len[d])).tolist()]
    unigram = Counter(train_ids)
    n = len(train_ids)
    contexts, counts = defaultdict(Counter), 3
    for i in range(counts, n):
        contexts[tuple(train_ids[i - counts:i])][train_ids[i]] += 1
    loss_uni = loss_ngram = total = 0.0
    for batch in val:
        for row, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
            for i in range(counts, len(row)):
                if labels[i] == -100:
                    continue
                y, seen = labels[i], contexts.get(tuple(row[i - counts + 1:i + 1]), Counter())
                p_uni = (unigram[y] + 1) / (n + tok.vocab_size)
                p = (seen[y] + p_uni * 4) / (sum(seen.values()) + 4)  # back off to the unigram
                loss_uni -= math.log(p_uni)
                loss_ngram -= math.log(p)
                total += 1
    assert total > 5000
    loss_uni, loss_ngram = loss_uni / total, loss_ngram / total
    assert loss_uni > 2.5 and loss_ngram < 0.5 * loss_uni, (loss_uni, loss_ngram)
