"""TokenCorpus: tokenised documents, each followed by one EOS, in flat token arrays.

The same structure comes from on-the-fly tokenisation (one in-memory array) and from prepared
shards (one np.memmap per shard), so both feed identical batches to the packer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from sonic.data.tokenizer import token_dtype

log = logging.getLogger(__name__)


@dataclass
class TokenCorpus:
    arrays: list  # token storage per shard: np.ndarray or np.memmap of the shard dtype
    doc_array: np.ndarray  # int32: which array holds document i
    doc_start: np.ndarray  # int64: where document i starts in its array
    doc_len: np.ndarray  # int64: tokens of document i, its trailing EOS included
    component_starts: list[int]  # mixture component c owns documents [starts[c], starts[c+1])
    eos_token_id: int
    empty_docs: int = 0  # documents skipped because they held no text

    def __post_init__(self):
        assert len(self.doc_array) == len(self.doc_start) == len(self.doc_len)
        assert self.component_starts[0] == 0 and self.component_starts[-1] == len(self.doc_len)

    @property
    def n_docs(self) -> int:
        return len(self.doc_len)

    @property
    def n_tokens(self) -> int:
        return int(self.doc_len.sum())

    def piece(self, doc: int, begin: int, end: int) -> np.ndarray:
        """Tokens [begin, end) of one document (a view: memory-mapped shards are not copied)."""
        start = self.doc_start[doc]
        return self.arrays[self.doc_array[doc]][start + begin:start + end]

    def component_docs(self, c: int) -> np.ndarray:
        return np.arange(self.component_starts[c], self.component_starts[c + 1])

    def __getstate__(self):
        """Memory maps travel to dataloader workers as (file, dtype, length), not as copies of the data."""
        state = dict(self.__dict__)
        state["arrays"] = [("memmap", a.filename, a.dtype.str, a.shape[0]) if isinstance(a, np.memmap) else a
                           for a in self.arrays]
        return state

    def __setstate__(self, state):
        state["arrays"] = [open_tokens(a[1], np.dtype(a[2]), a[3]) if isinstance(a, tuple) else a
                           for a in state["arrays"]]
        self.__dict__.update(state)


def open_tokens(path: str, dtype: np.dtype, length: int) -> np.ndarray:
    """Read-only memory map of a shard (an empty shard cannot be mapped, so it is an empty array)."""
    return np.memmap(path, dtype=dtype, mode="r", shape=(length,)) if length else np.zeros(0, dtype)


def tokenize_chunk(tokenizer, texts: Sequence[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, int]:
    """Concatenated `doc + EOS` tokens, per-document lengths, and the number of empty documents skipped.

    A document is empty when it holds only whitespace: it would add a bare EOS and teach nothing.
    """
    kept = [t for t in texts if t.strip()]
    docs = tokenizer.encode_batch(kept)
    lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    for doc, end in zip(docs, ends):
        tokens[end - len(doc) - 1:end - 1] = doc
        tokens[end - 1] = tokenizer.eos_token_id
    assert tokens.size == 0 or int(tokens.max()) < tokenizer.vocab_size, "token id beyond the tokenizer's vocab"
    return tokens, lengths, len(texts) - len(kept)


def tokenize_documents(documents: Iterable[tuple[int, str]], tokenizer, n_components: int,
                       labels: Sequence[str], chunk_docs: int = 1024) -> TokenCorpus:
    """Tokenise (component, text) pairs in memory; components arrive in order, 0 first."""
    dtype = token_dtype(tokenizer.vocab_size)
    token_parts, length_parts, empty = [], [], 0
    docs_per_component = [0] * n_components
    chunk, chunk_component = [], 0

    def flush():
        nonlocal empty
        tokens, lengths, n_empty = tokenize_chunk(tokenizer, chunk, dtype)
        token_parts.append(tokens), length_parts.append(lengths)
        docs_per_component[chunk_component] += len(lengths)
        empty += n_empty
        chunk.clear()

    for component, text in documents:
        assert component >= chunk_component, "components must arrive in order"
        if component != chunk_component or len(chunk) >= chunk_docs:
            flush()
            chunk_component = component
        chunk.append(text)
    flush()
    for c, n in enumerate(docs_per_component):
        if n == 0:
            raise ValueError(f"{labels[c]}: no non-empty documents; the dataset is empty "
                             "(check data.text_column / txt_docs, or remove the path)")
    if empty:
        log.info("skipped %d empty documents", empty)
    lengths = np.concatenate(length_parts)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return TokenCorpus(arrays=[np.concatenate(token_parts)], doc_array=np.zeros(len(lengths), np.int32),
                       doc_start=starts, doc_len=lengths,
                       component_starts=[0] + np.cumsum(docs_per_component).tolist(),
                       eos_token_id=tokenizer.eos_token_id, empty_docs=empty)
