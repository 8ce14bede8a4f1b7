"""Streaming sources (HF `datasets` IterableDataset): documents are read, tokenised and packed lazily.

Each (rank, worker) stream reads its own part of the dataset (whole files when there are at least
as many files as streams, else every n-th document of the whole stream), packs it sequentially and remembers where its next window
starts: the dataset's own state before the current read, the document within that read and the
token offset within the document.  That position is small and exact, so a resume re-reads at
most one read of documents.  Order is the dataset's order (HF reorders files on each pass via
`set_epoch`); the seed does not apply here.
"""
from __future__ import annotations

import copy
import hashlib
import inspect
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from sonic.data.packing import make_batch

READ_DOCS = 64  # documents per read from the dataset (and per tokenizer call)


def text_key(text: str) -> bytes:
    """Identity of a document's text, to keep validation documents out of training."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


@dataclass
class _Piece:
    tokens: np.ndarray  # the rest of a document, its EOS included
    position: dict  # where `tokens` start: {"epoch", "hf", "doc", "offset"}

    def rest(self, k: int) -> "_Piece":
        return _Piece(self.tokens[k:], {**self.position, "offset": self.position["offset"] + k})


class StreamPacker:
    """Packs one logical stream (rank x worker) of a streaming source into micro-batches."""

    def __init__(self, source, tokenizer, seq_len: int, micro_batch_size: int, stream: int, n_streams: int,
                 exclude: frozenset):
        self.source, self.tokenizer = source, tokenizer
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.stream, self.n_streams, self.exclude = stream, n_streams, exclude

    @staticmethod
    def initial_state() -> dict:
        return {"epoch": 0, "hf": None, "doc": 0, "offset": 0}

    def _split(self):
        """This stream's part: whole files, even when they do not divide evenly (streams are endless
        anyway), so no stream downloads the others' data; every n-th document when files are too few."""
        from datasets.distributed import split_dataset_by_node

        ds, options = self.source.ds, {}
        if ds.num_shards >= self.n_streams and "strategy" in inspect.signature(split_dataset_by_node).parameters:
            options["strategy"] = "shards"  # datasets >= 5; older versions fall back to "auto"
        return split_dataset_by_node(ds, rank=self.stream, world_size=self.n_streams, **options)

    def _pieces(self, state: dict) -> Iterator[_Piece]:
        """Whole documents from `state` on, forever, each tagged with its own start position."""
        ds = self._split()
        epoch, resume_hf = state["epoch"], state["hf"]
        skip_docs, skip_tokens = state["doc"], state["offset"]
        eos = self.tokenizer.eos_token_id
        while True:
            ds.set_epoch(epoch)
            if resume_hf is not None:
                ds.load_state_dict(resume_hf)
            reads, before, kept_any = ds.iter(batch_size=READ_DOCS), resume_hf, False
            for batch in reads:
                texts = self.source.batch_texts(batch)
                keep = [i for i, t in enumerate(texts)
                        if i >= skip_docs and t.strip() and text_key(t) not in self.exclude]
                kept_any = kept_any or bool(keep)
                for i, ids in zip(keep, self.tokenizer.encode_batch([texts[i] for i in keep])):
                    doc = np.append(np.asarray(ids, dtype=np.int64), eos)
                    start = skip_tokens if i == skip_docs else 0
                    yield _Piece(doc, {"epoch": epoch, "hf": before, "doc": i, "offset": 0}).rest(start)
                skip_docs, skip_tokens = 0, 0
                before = copy.deepcopy(ds.state_dict())
            if not kept_any and resume_hf is None:
                raise ValueError(f"{self.source.label}: stream {self.stream} of {self.n_streams} (ranks x "
                                 "dataloader workers) got no training documents; use fewer ranks or num_workers, "
                                 "or a dataset with more documents or files")
            epoch, resume_hf = epoch + 1, None

    def batches(self, state: dict):
        """(batch, position of the next window) forever, starting at `state`."""
        pieces = self._pieces(state)
        pending = [next(pieces)]
        need = self.seq_len + 1
        while True:
            windows = []
            for _ in range(self.micro_batch_size):
                parts, eos, have, i = [], [], 0, 0
                while have < need:
                    if i == len(pending):
                        pending.append(next(pieces))
                    take = min(len(pending[i].tokens), need - have)
                    parts.append(pending[i].tokens[:take])
                    have += take
                    if take == len(pending[i].tokens):
                        eos.append(have - 1)  # pieces run to their document's end
                    i += 1
                windows.append((np.concatenate(parts), np.asarray(eos, dtype=np.int64)))
                pending = [pending[i - 1].rest(take - 1)] + pending[i:]  # the last token starts the next window
            yield make_batch(windows, self.seq_len), copy.deepcopy(pending[0].position)
