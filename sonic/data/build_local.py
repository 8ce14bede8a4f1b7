"""Build (or find) everything `data=local_bpe` needs, and say what each part took:

    python -m sonic.data.build_local 100352 [--cache-dir ~/.cache/sonic]

the local text corpus, the local_bpe:<V> tokenizer and the corpus tokenised into shards. A training run
builds the same on first use; run this beforehand to time it, or to fill a cache that a multi-node job
shares (data.cache_dir on a filesystem every node sees).
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from sonic.data.config import DataConfig
from sonic.data.local_bpe import SPEC, ensure_local_bpe
from sonic.data.local_text import ensure_corpus
from sonic.data.prepare import ensure_shards
from sonic.data.tokenizer import DEFAULT_CACHE_DIR, build_tokenizer

FACTS = ("documents", "bytes", "bytes_by_kind", "sha256", "trained_tokens", "unused_tokens", "tokenizer_sha256",
         "train_seconds", "tokens", "build_seconds")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sonic.data.build_local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("vocab_size", type=int, help="tokens, e.g. 100352 (sonic_7b), 50304 (olmoe_1b_7b)")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="data.cache_dir")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = DataConfig(source="local_text", tokenizer=f"{SPEC}:{args.vocab_size}", cache_dir=args.cache_dir)
    steps = (("corpus", lambda: ensure_corpus(cfg.cache_dir)[0].parent),
             ("tokenizer", lambda: ensure_local_bpe(args.vocab_size, cfg.cache_dir)[0]),
             ("shards", lambda: ensure_shards(cfg, build_tokenizer(cfg))))
    for what, step in steps:
        start = time.perf_counter()
        directory = step()
        seconds = time.perf_counter() - start
        manifest = json.loads((Path(directory) / "manifest.json").read_text())
        facts = {k: manifest[k] for k in FACTS if k in manifest}
        print(f"{what}: {seconds:.1f} s in this call, {directory}\n  {facts}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
