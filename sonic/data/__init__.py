"""Data pipeline: sources -> tokenizer -> packing -> sharded, stateful loaders.

    tok = build_tokenizer(cfg)
    train, val = build_loaders(cfg, tokenizer=tok, seq_len=S, micro_batch_size=B, rank=r, world_size=w, seed=s)
"""
from sonic.data.config import DataConfig
from sonic.data.loader import TrainLoader, ValLoader, build_loaders
from sonic.data.tokenizer import build_tokenizer

__all__ = ["DataConfig", "build_tokenizer", "build_loaders", "TrainLoader", "ValLoader"]
