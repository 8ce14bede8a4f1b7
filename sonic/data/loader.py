"""The loaders the trainer calls: an endless, resumable training iterator and a finite validation set."""
from __future__ import annotations

import logging

import numpy as np
import torch

from sonic.data import documents, shards
from sonic.data.corpus import TokenCorpus, tokenize_documents
from sonic.data.packing import Layout, make_batch
from sonic.data.plan import TrainPlan, split_validation, val_windows
from sonic.data.streaming import StreamPacker, text_key

log = logging.getLogger(__name__)
STATE_VERSION = 1


class _IndexedStreams:
    """Batch t of a rank is a pure function of t; logical stream j serves t = j, j+n, j+2n, ..."""

    kind = "indexed"

    def __init__(self, plan: TrainPlan, rank: int, world_size: int, micro_batch_size: int):
        self.plan, self.rank, self.world_size, self.micro_batch_size = plan, rank, world_size, micro_batch_size

    def state_for(self, j: int, n: int, consumed: int) -> dict:
        """Stream j's next step once `consumed` batches are out: the first t >= consumed with t = j mod n."""
        return {"step": consumed + (j - consumed) % n}

    def initial_state(self, j: int, n: int) -> dict:
        return self.state_for(j, n, 0)

    def batches(self, j: int, n: int, state: dict):
        step, S, B = state["step"], self.plan.seq_len, self.micro_batch_size
        while True:
            first = (step * self.world_size + self.rank) * B
            yield make_batch([self.plan.window(first + b) for b in range(B)], S), {"step": step + n}
            step += n


class _StreamingStreams:
    """Logical stream j of rank r reads part rank*n+j of world_size*n of a streaming dataset."""

    kind = "streaming"

    def __init__(self, source, tokenizer, rank, world_size, seq_len, micro_batch_size, exclude):
        self.source, self.tokenizer, self.rank, self.world_size = source, tokenizer, rank, world_size
        self.seq_len, self.micro_batch_size, self.exclude = seq_len, micro_batch_size, exclude

    def initial_state(self, j: int, n: int) -> dict:
        return StreamPacker.initial_state()

    def batches(self, j: int, n: int, state: dict):
        packer = StreamPacker(self.source, self.tokenizer, self.seq_len, self.micro_batch_size,
                              stream=self.rank * n + j, n_streams=self.world_size * n, exclude=self.exclude)
        yield from packer.batches(state)


class _WorkerStreams(torch.utils.data.IterableDataset):
    """Dataloader worker p runs logical stream (first + p) % n, so round-robin order survives a resume."""

    def __init__(self, streams, n: int, first: int, states: list[dict]):
        super().__init__()
        self.streams, self.n, self.first, self.states = streams, n, first, states

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        j = (self.first + (info.id if info else 0)) % self.n
        for batch, state in self.streams.batches(j, self.n, self.states[j]):
            yield batch, j, state


class TrainLoader:
    """Endless training batches for one rank; `state_dict()` after k batches resumes at batch k+1 exactly."""

    def __init__(self, streams, num_workers: int, fingerprint: dict):
        self.streams, self.num_workers, self.fingerprint = streams, num_workers, fingerprint
        self.n = max(1, num_workers)
        self.consumed = 0
        self.states = [streams.initial_state(j, self.n) for j in range(self.n)]
        self._iterator = None  # started on the first next(), restarted by load_state_dict

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._iterator is None:
            self._iterator = self._start()
        batch, j, state = next(self._iterator)
        assert j == self.consumed % self.n, "batches must arrive in round-robin stream order"
        self.states[j] = state
        self.consumed += 1
        return batch

    def _start(self):
        first = self.consumed % self.n
        dataset = _WorkerStreams(self.streams, self.n, first, list(self.states))
        if self.num_workers == 0:
            return iter(dataset)
        return iter(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=self.num_workers,
                                                persistent_workers=False, prefetch_factor=4))

    def state_dict(self) -> dict:
        state = {"version": STATE_VERSION, "kind": self.streams.kind, "consumed": self.consumed,
                 "fingerprint": dict(self.fingerprint)}
        if self.streams.kind == "streaming":
            state["streams"] = [dict(s) for s in self.states]
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION or state.get("kind") != self.streams.kind:
            raise ValueError(f"data loader state is from a different loader ({state.get('kind')!r}, version "
                             f"{state.get('version')}); resume with the data config it was saved with")
        changed = {k: (v, self.fingerprint.get(k)) for k, v in state["fingerprint"].items()
                   if self.fingerprint.get(k) != v}
        if changed:
            what = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in changed.items())
            raise ValueError(f"data loader state does not match this run ({what}); resume with the same data "
                             "config, seed, seq_len, micro_batch_size and world size (streaming: also rank and "
                             "num_workers, so save train.state_dict() on every rank)")
        self._iterator = None  # drops any running workers
        self.consumed = int(state["consumed"])
        self.states = ([self.streams.state_for(j, self.n, self.consumed) for j in range(self.n)]
                       if self.streams.kind == "indexed" else [dict(s) for s in state["streams"]])


class ValLoader:
    """Finite, fixed validation batches for one rank: every held-out token is a target exactly once over
    all ranks; ranks get equally many batches, padded with fully ignored rows (labels -100).

    Windows go to ranks row by row (window (k*B + b)*world + rank), so the last batch's real rows are
    spread over ranks and a rank sees a batch without any target only when fewer windows than ranks remain.
    """

    def __init__(self, corpus: TokenCorpus, docs: np.ndarray, seq_len: int, micro_batch_size: int,
                 rank: int, world_size: int):
        self.layout = Layout(corpus, docs)
        self.seq_len, self.micro_batch_size, self.rank, self.world_size = seq_len, micro_batch_size, rank, world_size
        self.windows = val_windows(corpus, docs, seq_len)
        rows = world_size * micro_batch_size
        self.n_batches = -(-len(self.windows) // rows)
        self.tokens = sum(n for _, n in self.windows)  # targets over all ranks

    def __len__(self) -> int:
        return self.n_batches

    def __iter__(self):
        S, B, pad = self.seq_len, self.micro_batch_size, self.layout.corpus.eos_token_id
        for k in range(self.n_batches):
            rows, valid = [], []
            for b in range(B):
                w = (k * B + b) * self.world_size + self.rank
                if w < len(self.windows):
                    start, n = self.windows[w]
                    tokens, eos = self.layout.read(start, n + 1)
                    rows.append((np.pad(tokens, (0, S + 1 - len(tokens)), constant_values=pad), eos))
                    valid.append(n)
                else:
                    rows.append((np.full(S + 1, pad, dtype=np.int64), np.zeros(0, np.int64)))
                    valid.append(0)
            yield make_batch(rows, S, valid)


def load_corpus(cfg, tokenizer) -> TokenCorpus:
    """All documents of a non-streaming source, tokenised (or memory-mapped when prepared)."""
    if cfg.source == "shards":
        return shards.load(cfg.paths, tokenizer)
    if cfg.source == "local_text":  # tokenised once into cached shards, memory-mapped by every rank
        # imported here, not with the package: `python -m sonic.data.prepare` runs prepare as __main__,
        # and runpy warns when the package has imported it already
        from sonic.data.prepare import ensure_shards

        return shards.load([str(ensure_shards(cfg, tokenizer))], tokenizer)
    n = len(documents.components(cfg)) if cfg.source != "hf" else 1
    labels = [documents.source_label(cfg, c) for c in range(n)]
    return tokenize_documents(documents.iter_documents(cfg), tokenizer, n, labels)


def _first_docs(source, n: int) -> list[str]:
    """The first n non-empty documents of a `datasets` source (validation for hf / streaming sources)."""
    texts = []
    for text in source.texts(batch_size=min(n, 1000)):
        if text.strip():
            texts.append(text)
            if len(texts) == n:
                break
    return texts


def _val_from_split(cfg, tokenizer) -> TokenCorpus:
    """The first val_docs non-empty documents of data.val_split."""
    source = documents.open_hf(cfg, cfg.val_split, streaming=cfg.streaming)
    return tokenize_documents(((0, t) for t in _first_docs(source, cfg.val_docs)), tokenizer, 1, [source.label])


def build_loaders(cfg, tokenizer, seq_len: int, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                  seed: int = 0) -> tuple[TrainLoader, ValLoader]:
    """Training iterator (endless, stateful) and validation loader (finite) for this rank."""
    for name, value, low in (("seq_len", seq_len, 1), ("micro_batch_size", micro_batch_size, 1),
                             ("world_size", world_size, 1), ("seed", seed, 0)):
        if value < low:
            raise ValueError(f"{name}={value} must be >= {low}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    fingerprint = {"source": cfg.source, "name": cfg.name, "paths": list(cfg.paths), "tokenizer": tokenizer.name,
                   "seed": seed, "seq_len": seq_len, "micro_batch_size": micro_batch_size, "world_size": world_size}
    build = _streaming if cfg.streaming else _indexed
    streams, val_corpus, val_docs = build(cfg, tokenizer, seq_len, micro_batch_size, rank, world_size, seed,
                                          fingerprint)
    return (TrainLoader(streams, cfg.num_workers, fingerprint),
            ValLoader(val_corpus, val_docs, seq_len, micro_batch_size, rank, world_size))


def _indexed(cfg, tokenizer, seq_len, micro_batch_size, rank, world_size, seed, fingerprint):
    """All documents in memory or memory-mapped: batches are a pure function of (seed, step)."""
    corpus = load_corpus(cfg, tokenizer)
    if cfg.val_split:
        train_docs, val_corpus = [corpus.component_docs(0)], _val_from_split(cfg, tokenizer)
        val_docs = np.arange(val_corpus.n_docs)
    else:
        label = ", ".join(cfg.paths) if cfg.source == "shards" else documents.source_label(cfg)
        (train_docs, val_docs), val_corpus = split_validation(corpus, cfg.val_docs, label), corpus
    plan = TrainPlan(corpus, train_docs, cfg.weights, seed, seq_len)
    plan.locate(0)  # fails now, not mid-training, when an epoch is shorter than one window
    fingerprint.update(docs=corpus.n_docs, tokens=corpus.n_tokens,
                       weights=None if cfg.weights is None else [float(w) for w in cfg.weights])
    log.info("data: %d documents, %d tokens (%d empty skipped), %d held out for validation",
             corpus.n_docs, corpus.n_tokens, corpus.empty_docs, len(val_docs))
    return _IndexedStreams(plan, rank, world_size, micro_batch_size), val_corpus, val_docs


def _streaming(cfg, tokenizer, seq_len, micro_batch_size, rank, world_size, seed, fingerprint):
    """Documents read lazily; validation is the stream's first val_docs documents, kept out of training."""
    source = documents.open_hf(cfg, cfg.split, streaming=True)
    if cfg.val_split:
        val_corpus, exclude = _val_from_split(cfg, tokenizer), frozenset()
    else:
        held = _first_docs(source, cfg.val_docs)
        if len(held) < cfg.val_docs:
            raise ValueError(f"{source.label}: data.val_docs={cfg.val_docs} would hold out all {len(held)} "
                             "non-empty documents; lower val_docs")
        val_corpus = tokenize_documents(((0, t) for t in held), tokenizer, 1, [source.label])
        exclude = frozenset(text_key(t) for t in held)
    fingerprint.update(rank=rank, num_workers=cfg.num_workers)
    streams = _StreamingStreams(source, tokenizer, rank, world_size, seq_len, micro_batch_size, exclude)
    return streams, val_corpus, np.arange(val_corpus.n_docs)
