"""`tokenizer: local_bpe:<V>`: a byte-level BPE with V tokens, trained on the local text corpus, cached.

The large presets' offline stand-in for a real tokenizer (the byte tokenizer uses 259 of their 50k-150k
ids, which makes their routers collapse). GPT-2 / Llama-3 style: Llama-3's pre-tokenizer split, bytes
mapped to 256 visible characters, no normaliser, so any text round-trips; `<|endoftext|>` (id 0) is
the EOS that separates packed documents and `<|pad|>` (id 1) the padding. The vocabulary is exactly V:
when the corpus supports fewer merges (a small corpus or a large V), unused special tokens
`<|unused_i|>` fill the rest, and the log says how many.

Built once per (corpus sha256, V, `tokenizers` version, FORMAT) under data.cache_dir, in the Hugging
Face format, so `AutoTokenizer.from_pretrained(directory)` loads it (a PreTrainedTokenizerFast).
Training is deterministic: one corpus gives one tokenizer, whose sha256 the manifest and log record.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Iterable

from sonic.data import cache
from sonic.data.local_text import ensure_corpus, read_jsonl_texts

log = logging.getLogger(__name__)

SPEC = "local_bpe"
FORMAT = 1  # bump when the recipe below changes: cached tokenizers then rebuild
EOS, PAD = "<|endoftext|>", "<|pad|>"
MIN_VOCAB = 256 + 2  # the byte alphabet and the two special tokens
MIN_FREQUENCY = 2  # a pair seen once is no merge
# Llama-3's split: contractions, letter runs with one leading non-letter, numbers of <= 3 digits,
# punctuation runs, newlines, and whitespace runs (so code's indentation becomes few tokens).
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def parse(name: str) -> int | None:
    """V of a `local_bpe:<V>` tokenizer name; None for every other name."""
    if name != SPEC and not name.startswith(SPEC + ":"):
        return None
    fix = f"write local_bpe:<vocab size>, e.g. local_bpe:${{model.vocab_size}}, with a size >= {MIN_VOCAB}"
    try:
        vocab_size = int(name.partition(":")[2])
    except ValueError:
        raise ValueError(f"data.tokenizer={name!r}: {fix}") from None
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"data.tokenizer={name!r}: {fix} (256 bytes + <|endoftext|> + <|pad|>)")
    return vocab_size


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> dict:
    """Trains the tokenizer on `texts` and saves it (HF format) in out_dir; returns what came out."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"local_bpe vocab_size={vocab_size} must be >= {MIN_VOCAB} (256 bytes + 2 special tokens)")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=MIN_FREQUENCY, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    seen = {"documents": 0, "bytes": 0}

    def counted():
        for text in texts:
            if text.strip():
                seen["documents"] += 1
                seen["bytes"] += len(text.encode())
                yield text

    start = time.perf_counter()
    tk.train_from_iterator(counted(), trainer)
    seconds = time.perf_counter() - start
    if seen["documents"] == 0:
        raise ValueError("local_bpe: no text to train the tokenizer on (every document is empty)")
    trained = tk.get_vocab_size()
    if trained < vocab_size:
        tk.add_special_tokens([f"<|unused_{i}|>" for i in range(vocab_size - trained)])
    assert tk.get_vocab_size() == vocab_size, (tk.get_vocab_size(), vocab_size)
    out_dir = Path(out_dir)
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS, pad_token=PAD).save_pretrained(str(out_dir))
    # The portable class name (transformers 5 writes its own, which 4.x cannot load).
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return {"vocab_size": vocab_size, "trained_tokens": trained, "unused_tokens": vocab_size - trained,
            "train_documents": seen["documents"], "train_bytes": seen["bytes"], "train_seconds": round(seconds, 1)}


def ensure_local_bpe(vocab_size: int, cache_dir: str) -> tuple[Path, dict]:
    """(directory, manifest) of the local_bpe tokenizer with `vocab_size` tokens, trained on this machine's
    local text corpus the first time and reused after."""
    import tokenizers

    corpus_path, corpus = ensure_corpus(cache_dir)
    key = cache.digest({"corpus_sha256": corpus["sha256"], "vocab_size": vocab_size,
                        "tokenizers": tokenizers.__version__, "format": FORMAT})
    entry = Path(cache_dir).expanduser() / SPEC / f"v{vocab_size}-{key[:16]}"

    def build(tmp: Path) -> dict:
        log.info("training the %s:%d tokenizer on the local text corpus (%.1f MiB, sha256 %s) into %s", SPEC,
                 vocab_size, corpus["bytes"] / 2**20, corpus["sha256"][:12], entry)
        info = train_bpe(read_jsonl_texts(corpus_path), vocab_size, tmp)
        if info["unused_tokens"]:
            log.warning("%s:%d: the corpus supports only %d tokens (merges seen >= %d times); the other %d ids are "
                        "unused special tokens <|unused_i|>", SPEC, vocab_size, info["trained_tokens"],
                        MIN_FREQUENCY, info["unused_tokens"])
        return {**info, "corpus_sha256": corpus["sha256"], "tokenizers": tokenizers.__version__, "format": FORMAT,
                "tokenizer_sha256": cache.file_sha256(tmp / "tokenizer.json")}

    manifest = cache.ensure(entry, build, f"the {SPEC}:{vocab_size} tokenizer")
    log.info("%s:%d tokenizer %s: %d trained tokens + %d unused, sha256 %s (corpus sha256 %s)", SPEC, vocab_size,
             entry, manifest["trained_tokens"], manifest["unused_tokens"], manifest["tokenizer_sha256"][:12],
             manifest["corpus_sha256"][:12])
    return entry, manifest

