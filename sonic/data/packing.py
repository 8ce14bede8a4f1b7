"""Packing: documents concatenated (each ending in EOS) and cut into fixed-length windows.

A window holds S+1 tokens: inputs are the first S, labels the last S, and consecutive windows
overlap by that one token, so every token is an input exactly once.  doc_ids count documents
inside a window: each EOS opens the next document (it acts as that document's BOS), so under
document-masked attention no prediction sees another document, while the last token of each
document still learns to predict EOS.
"""
from __future__ import annotations

import numpy as np
import torch

IGNORE = -100  # label of positions with no target (padding)


class Layout:
    """Documents in a given order, viewed as one token stream: offset -> (document, position)."""

    def __init__(self, corpus, order: np.ndarray):
        self.corpus, self.order = corpus, order
        self.ends = np.cumsum(corpus.doc_len[order])
        self.total = int(self.ends[-1]) if len(order) else 0

    def read(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [start, start+length) as int64, and the positions in it that hold a document's EOS."""
        assert 0 <= start and start + length <= self.total, (start, length, self.total)
        out = np.empty(length, dtype=np.int64)
        eos = []
        i = int(np.searchsorted(self.ends, start, side="right"))
        pos = start - (int(self.ends[i]) - int(self.corpus.doc_len[self.order[i]]))
        written = 0
        while written < length:
            doc = self.order[i]
            doc_len = int(self.corpus.doc_len[doc])
            take = min(doc_len - pos, length - written)
            out[written:written + take] = self.corpus.piece(doc, pos, pos + take)
            written += take
            if pos + take == doc_len:
                eos.append(written - 1)
            i, pos = i + 1, 0
        return out, np.asarray(eos, dtype=np.int64)


def doc_ids_from_eos(seq_len: int, eos: np.ndarray) -> np.ndarray:
    """Document index per position: +1 at each EOS after the first position (the EOS opens a document)."""
    marks = np.zeros(seq_len, dtype=np.int64)
    eos = eos[(eos > 0) & (eos < seq_len)]
    marks[eos] = 1
    return np.cumsum(marks)


def make_batch(windows: list[tuple[np.ndarray, np.ndarray]], seq_len: int, valid: list[int] | None = None) -> dict:
    """Stacks (tokens[S+1], eos positions) windows into the trainer's batch dict.

    `valid[b]` < S marks how many leading inputs of window b have a real target (the rest is padding).
    """
    rows = len(windows)
    tokens = np.stack([w for w, _ in windows])
    assert tokens.shape == (rows, seq_len + 1)
    doc_ids = np.stack([doc_ids_from_eos(seq_len, eos) for _, eos in windows])
    labels = tokens[:, 1:].copy()
    if valid is not None:
        for b, n in enumerate(valid):
            labels[b, n:] = IGNORE
            doc_ids[b, n:] = doc_ids[b, n - 1] + 1 if n else 0
    return {"input_ids": torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
            "labels": torch.from_numpy(labels),
            "doc_ids": torch.from_numpy(doc_ids)}
