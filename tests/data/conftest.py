"""Local corpora and a word-level tokenizer built in tmp dirs: the data tests never touch the network.

The word tokenizer maps words w0, w1, ... to distinct ids, and the corpora below use every word once,
so each token id names one (document, position): coverage and disjointness become set arithmetic.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from sonic.data import DataConfig, build_tokenizer

EOS = "<eos>"


def word_docs(n_docs: int, seed: int = 0, max_words: int = 40, first: int = 0, prefix: str = "w") -> list[str]:
    """Documents of distinct words (w{first}, w{first+1}, ...), varied lengths."""
    lengths = np.random.default_rng(seed).integers(1, max_words + 1, size=n_docs)
    docs, k = [], first
    for n in lengths:
        docs.append(" ".join(f"{prefix}{i}" for i in range(k, k + n)))
        k += n
    return docs


def write_jsonl(path, texts, key: str = "text"):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def word_tokenizer_dir(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"{prefix}{i}" for prefix, count in (("w", 40_000), ("a", 15_000), ("b", 15_000)) for i in range(count)]
    vocab = {w: i for i, w in enumerate([EOS, "<unk>", *words])}  # > 65536 ids: shards use uint32
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory = str(tmp_path_factory.mktemp("word_tokenizer"))
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS, unk_token="<unk>").save_pretrained(directory)
    return directory


@pytest.fixture
def word_corpus(tmp_path, word_tokenizer_dir):
    """(config, tokenizer, documents) for 300 unique-word documents in one jsonl file."""
    docs = word_docs(300)
    cfg = DataConfig(source="files", paths=[write_jsonl(tmp_path / "docs.jsonl", docs)],
                     tokenizer=word_tokenizer_dir, val_docs=20)
    return cfg, build_tokenizer(cfg), docs


def take(loader, n: int) -> list[dict]:
    return [next(loader) for _ in range(n)]


def same_batches(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(all((x[k] == y[k]).all() for k in ("input_ids", "labels", "doc_ids"))
                                    for x, y in zip(a, b))
