"""Which window of which epoch every rank reads: a pure function of (seed, step), hence exact resume.

Epoch e draws each mixture component's documents from that component's endless stream of
shuffled passes (component c contributes n_c documents per epoch, so weights set token shares),
shuffles them together, concatenates them, cuts the stream into windows of S (+1) tokens and
visits the windows in a shuffled order.  Global window g = (step * world + rank) * B + b, so
ranks read disjoint windows and one epoch's windows cover every token of its documents once
(up to the last partial window, < S tokens, which the next epoch places elsewhere).
"""
from __future__ import annotations

import numpy as np

from sonic.data.packing import Layout

_COMPONENT, _MIX, _WINDOWS, _VAL = 1, 2, 3, 4  # independent RNG streams per purpose
VAL_SEED = 0  # validation is the same documents for every training seed


def rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in keys])


def split_validation(corpus, val_docs: int, label: str) -> tuple[list[np.ndarray], np.ndarray]:
    """Training documents per component, and the held-out validation documents (sorted)."""
    if val_docs >= corpus.n_docs:
        raise ValueError(f"{label}: data.val_docs={val_docs} leaves no training documents out of "
                         f"{corpus.n_docs}; lower data.val_docs")
    held = np.sort(rng(VAL_SEED, _VAL).permutation(corpus.n_docs)[:val_docs])
    keep = np.ones(corpus.n_docs, dtype=bool)
    keep[held] = False
    train = []
    for c in range(len(corpus.component_starts) - 1):
        docs = corpus.component_docs(c)
        docs = docs[keep[docs]]
        if len(docs) == 0:
            raise ValueError(f"{label}: mixture component {c} has no training documents left after holding out "
                             f"data.val_docs={val_docs}; lower val_docs or give it more data")
        train.append(docs)
    return train, held


class TrainPlan:
    def __init__(self, corpus, train_docs: list[np.ndarray], weights: list[float] | None, seed: int, seq_len: int):
        self.corpus, self.train_docs, self.seed, self.seq_len = corpus, train_docs, seed, seq_len
        self.per_epoch = self._docs_per_epoch(weights)
        self._epoch_starts = [0]  # first global window of each epoch seen so far
        self._cached = (-1, None, None)

    def _docs_per_epoch(self, weights) -> list[int]:
        """n_c: component c's documents per epoch; its share of an epoch's tokens follows its weight."""
        if weights is None:
            return [len(d) for d in self.train_docs]
        assert len(weights) == len(self.train_docs)
        tokens = [int(self.corpus.doc_len[d].sum()) for d in self.train_docs]
        total, wsum = sum(tokens), sum(weights)
        return [max(1, round(w / wsum * total / (t / len(d)))) for w, t, d in zip(weights, tokens, self.train_docs)]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Documents of one epoch, in reading order."""
        parts = []
        for c, (docs, n) in enumerate(zip(self.train_docs, self.per_epoch)):
            first, last = epoch * n, (epoch + 1) * n  # positions in the component's endless stream
            passes = [docs[rng(self.seed, _COMPONENT, c, k).permutation(len(docs))]
                      for k in range(first // len(docs), (last - 1) // len(docs) + 1)]
            offset = (first // len(docs)) * len(docs)
            parts.append(np.concatenate(passes)[first - offset:last - offset])
        order = np.concatenate(parts)
        return order if len(parts) == 1 else order[rng(self.seed, _MIX, epoch).permutation(len(order))]

    def _epoch(self, epoch: int):
        if self._cached[0] != epoch:
            layout = Layout(self.corpus, self.epoch_order(epoch))
            n_windows = (layout.total - 1) // self.seq_len
            if n_windows < 1:
                raise ValueError(f"an epoch holds {layout.total} training tokens, fewer than seq_len+1="
                                 f"{self.seq_len + 1}; use more data or a shorter seq_len")
            self._cached = (epoch, layout, rng(self.seed, _WINDOWS, epoch).permutation(n_windows))
        return self._cached[1], self._cached[2]

    def locate(self, g: int) -> tuple[int, int]:
        """(epoch, window index within it) of global window g."""
        while self._epoch_starts[-1] <= g:
            e = len(self._epoch_starts) - 1
            self._epoch_starts.append(self._epoch_starts[-1] + len(self._epoch(e)[1]))
        e = int(np.searchsorted(self._epoch_starts, g, side="right")) - 1
        return e, g - self._epoch_starts[e]

    def window(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [S+1] of global window g and its EOS positions."""
        epoch, j = self.locate(g)
        layout, order = self._epoch(epoch)
        return layout.read(int(order[j]) * self.seq_len, self.seq_len + 1)


def val_windows(corpus, docs: np.ndarray, seq_len: int) -> list[tuple[int, int]]:
    """(start, inputs with a target) of each validation window over `docs` concatenated in order."""
    total = int(corpus.doc_len[docs].sum())
    predicted = total - 1  # the last token has no next token
    return [(s, min(seq_len, predicted - s)) for s in range(0, predicted, seq_len)]
