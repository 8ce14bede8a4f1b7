"""Tokenizers behind one small interface: `encode` never adds special tokens and never parses them out of text.

Why a wrapper: HF tokenizers differ in what `encode` adds (BOS, EOS) and they turn literal
"</s>" or "<|endoftext|>" inside a document into real special tokens; packing inserts exactly one
EOS between documents itself, so every tokenizer here encodes plain text only.
"""
from __future__ import annotations

import hashlib
import os
from typing import Sequence

import numpy as np

from sonic.data import local_bpe

BYTE = "byte"
DEFAULT_CACHE_DIR = "~/.cache/sonic"  # DataConfig.cache_dir's default: where local_bpe tokenizers are built


class ByteTokenizer:
    """Offline UTF-8 byte tokenizer with ByT5's id layout (pad 0, eos 1, unk 2, byte b -> b + 3)."""

    name = BYTE
    pad_token_id, eos_token_id, unk_token_id = 0, 1, 2
    _offset = 3
    vocab_size = 256 + _offset

    def encode(self, text: str) -> list[int]:
        return self.encode_np(text).tolist()

    def encode_np(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + self._offset

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode_np(t) for t in texts]

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return (ids[ids >= self._offset] - self._offset).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size


class HFTokenizer:
    """A transformers tokenizer with plain-text `encode`; `.hf` is the wrapped tokenizer."""

    def __init__(self, name: str, hf):
        self.name, self.hf = name, hf
        eos = hf.eos_token_id if hf.eos_token_id is not None else hf.sep_token_id
        if eos is None:
            raise ValueError(f"data.tokenizer={name!r} has no eos (or sep) token to separate documents; "
                             "pick a tokenizer with an EOS token or use tokenizer: byte")
        self.eos_token_id = int(eos)
        self.pad_token_id = hf.pad_token_id
        self.vocab_size = max(len(hf), hf.vocab_size)  # len() counts added tokens, vocab_size may not

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if not texts:
            return []
        ids = self.hf(list(texts), add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return [np.asarray(x, dtype=np.int64) for x in ids]

    def decode(self, ids) -> str:
        return self.hf.decode(list(np.asarray(ids).reshape(-1).tolist()))

    def __len__(self) -> int:
        return self.vocab_size


def load_tokenizer(name: str, cache_dir: str = DEFAULT_CACHE_DIR) -> ByteTokenizer | HFTokenizer:
    """`byte`, `local_bpe:<V>` (trained here on first use, cached in cache_dir), a local tokenizer directory,
    or a Hub name (from the HF cache first, then the network)."""
    if name == BYTE:
        return ByteTokenizer()
    vocab_size = local_bpe.parse(name)
    if vocab_size is not None:
        from transformers import AutoTokenizer

        directory, _ = local_bpe.ensure_local_bpe(vocab_size, cache_dir)
        return HFTokenizer(name, AutoTokenizer.from_pretrained(str(directory), local_files_only=True))
    from huggingface_hub import constants
    from transformers import AutoTokenizer

    fix = ("use tokenizer: byte (needs no files), local_bpe:<vocab size> (trained offline) or a local tokenizer "
           "directory")
    path = os.path.expanduser(name)
    try:
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as local_error:
        looks_local = os.path.isdir(path) or name.startswith(("/", ".", "~"))
        if looks_local or constants.HF_HUB_OFFLINE:
            raise ValueError(f"data.tokenizer={name!r} cannot be loaded offline ({_first_line(local_error)}); "
                             f"{fix}") from local_error
        try:
            hf = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as error:
            raise ValueError(f"data.tokenizer={name!r} could not be loaded: it is not a local directory, not in the "
                             f"HF cache, and the Hub said: {_first_line(error)}. Either {fix}, or download it once "
                             "with network (HF_HUB_OFFLINE=1 skips the Hub's retries)") from error
    return HFTokenizer(name, hf)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def build_tokenizer(cfg) -> ByteTokenizer | HFTokenizer:
    """The tokenizer named by `cfg.tokenizer` (a DataConfig)."""
    return load_tokenizer(cfg.tokenizer, cfg.cache_dir)


def tokenizer_digest(tokenizer) -> str:
    """Identity of a tokenizer's vocabulary and rules (keys caches of its token ids)."""
    backend = getattr(getattr(tokenizer, "hf", None), "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: its whole definition
        return hashlib.sha256(backend.to_str().encode()).hexdigest()
    return f"{tokenizer.name}:{tokenizer.vocab_size}:{tokenizer.eos_token_id}"


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id: shards and in-memory corpora share it."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)
