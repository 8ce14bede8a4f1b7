"""Data pipeline: sources -> tokenizer -> packing -> sharded, stateful loaders.

    tok = build_tokenizer(cfg)
    train, val = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=r, world_size=w, seed=s)

The modules form a line, each importing only from its own stage or an earlier one (tests/data/test_layers.py):

  sources    cache (built-once entries), local_text (offline text: the embedded corpus and this
             machine's), make_corpus (writes the embedded corpus), documents (every source's raw documents)
  tokenizer  local_bpe (the offline BPE), tokenizer, config
  packing    corpus (tokenised documents), packing, plan (indexed batches), streaming
  shards     shards (read), prepare (write; the local text corpus's cached shards), build_local
  loader     loader
"""
from sonic.data.config import DataConfig
from sonic.data.loader import TrainLoader, ValLoader, build_loaders
from sonic.data.tokenizer import build_tokenizer

__all__ = ["DataConfig", "build_tokenizer", "build_loaders", "TrainLoader", "ValLoader"]
