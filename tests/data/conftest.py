"""Local corpora and a word-level tokenizer built in tmp dirs: the data tests never touch the network.

The word tokenizer maps words w0, w1, ... to distinct ids, and the corpora below use every word once,
so each token id names one (document, position): coverage and disjointness become set arithmetic.
"""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from sonic.data import DataConfig, build_tokenizer, local_text

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


PROSE = ("The router sends each token to its top experts. Experts are small feed-forward networks, and a "
         "balanced load keeps every one of them busy.\n")
CODE = "def f(x):\n    return x + {i}\n"


def write_sources(root, n_code=12, n_prose=6):
    """(code files, prose files): distinct small Python files and English docs, plus a data table,
    a duplicate and a non-UTF-8 file that the corpus leaves out."""
    root.mkdir(parents=True, exist_ok=True)
    code = []
    for i in range(n_code):
        code.append(root / f"m{i}.py")
        code[-1].write_text(CODE.format(i=i) * (i + 1))
    prose = []
    for i in range(n_prose):
        prose.append(root / f"doc{i}.md")
        prose[-1].write_text(f"# Part {i}\n\n" + PROSE * (i + 1))
    (root / "table.txt").write_text("1.0 2.0 3.0\n" * 50)  # a data table, not prose
    (root / "copy.md").write_text(prose[0].read_text())  # a duplicate
    (root / "latin.txt").write_bytes(b"caf\xe9 " * 20)  # not UTF-8
    with gzip.open(root / "changelog.gz", "wt") as f:
        f.write("pkg (1.0) unstable; urgency=low\n\n  * Fixed the build on every architecture.\n")
    prose += [root / "table.txt", root / "copy.md", root / "latin.txt", root / "changelog.gz"]
    return code, prose


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """The local installation (local_text's code and prose files) replaced by a few small files."""
    code, prose = write_sources(tmp_path / "src")
    monkeypatch.setattr(local_text, "python_sources", lambda: list(code))
    monkeypatch.setattr(local_text, "prose_sources", lambda: list(prose))
    return code, prose
