"""Apply activation checkpointing, torch.compile and FSDP-2 to a Transformer.

Order matters and follows torchtitan: AC wraps each block, compile compiles each
(wrapped) block, then fully_shard shards each block and finally the root.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from sonic.parallel.config import ParallelConfig
from sonic.parallel.distributed import DistInfo

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _expert_placement(shard_size: int):
    """Shard stacked expert weights on dim 0 (experts) when E divides evenly, else on the
    first dim that does, so no rank holds padding; other params use FSDP's default dim 0."""

    def placement(param: nn.Parameter) -> Shard | None:
        if param.dim() < 3:
            return None
        for dim, size in enumerate(param.shape):
            if size % shard_size == 0:
                return Shard(dim)
        return None

    return placement


def parallelize(model: nn.Module, cfg: ParallelConfig, info: DistInfo) -> nn.Module:
    layers = model.layers
    for i, block in enumerate(layers):
        if cfg.activation_checkpoint == "full" or (cfg.activation_checkpoint == "selective" and i % cfg.ac_every == 0):
            # Recompute re-runs the router on the same input with the RNG state restored,
            # so the recomputed routing equals the original one.
            block = checkpoint_wrapper(block, preserve_rng_state=True)
        if cfg.compile:
            block.compile()
        layers[i] = block
    if info.mesh is None:
        return model
    mesh = info.mesh if cfg.dp_replicate > 1 else info.mesh["dp_shard"]
    on_gpu = info.device.type == "cuda"  # bf16 compute on CPU would only be slow and inexact
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype] if on_gpu else torch.float32,
                              reduce_dtype=DTYPES[cfg.reduce_dtype] if on_gpu else torch.float32)
    shard_size = info.mesh["dp_shard"].size()
    for i, block in enumerate(layers):
        last = i == len(layers) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, shard_placement_fn=_expert_placement(shard_size),
                    reshard_after_forward=cfg.reshard_after_forward and not last)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip FSDP's reduce-scatter on all but the last micro-batch of an accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
