"""Meta-device initialisation: build the model on `meta`, shard it, then give each rank storage
for its own shards only and initialise them. No rank ever holds the full model; the transient
peak is one full parameter (Transformer.init_weights draws each full tensor, keeps its shard).

The weights are bit-identical to initialising the whole model in one process and sharding it
afterwards (tests/parallel/test_meta_init.py), at any world size.
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from sonic.models import ModelConfig, Transformer
from sonic.parallel.config import ParallelConfig
from sonic.parallel.distributed import DistInfo, all_reduce_
from sonic.parallel.parallelize import parallelize

log = logging.getLogger("sonic")


def build_model(cfg: ModelConfig, pcfg: ParallelConfig, info: DistInfo, seed: int) -> nn.Module:
    """The parallelized model (compile, activation checkpointing, FSDP-2 on a mesh), initialised
    from `seed` on info.device. One process without a mesh gets the whole model, unsharded."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = parallelize(model, pcfg, info)
    model.to_empty(device=info.device)  # FSDP re-registers its (padded) shards here
    model.init_weights(seed)
    return model


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded) tensors, e.g. another run's weights, into a model from `build_model`:
    each rank keeps its own shard of every tensor."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def local_model_gib(model: nn.Module) -> float:
    """GiB of parameters and buffers this rank stores (its own shards under FSDP)."""
    tensors = [*model.parameters(), *model.buffers()]
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local) / 2**30


def memory_after_init(model: nn.Module, info: DistInfo) -> dict[str, float]:
    """Every rank's memory right after initialisation, as metrics (a collective: call on all ranks).

    On a GPU: torch.cuda.memory_allocated (`mem_after_init_gib`) and max_memory_allocated, so
    including init's transient (`mem_after_init_peak_gib`). A CPU keeps no allocator statistics:
    there `mem_after_init_gib` is the bytes of the model's local tensors (what a GPU allocates for
    them, give or take FSDP's padding). Keys: the largest value over ranks, and `<name>/<rank>`.
    """
    mine = {"mem_after_init_gib": local_model_gib(model)}
    if info.device.type == "cuda":
        mine = {"mem_after_init_gib": torch.cuda.memory_allocated(info.device) / 2**30,
                "mem_after_init_peak_gib": torch.cuda.max_memory_allocated(info.device) / 2**30}
    per_rank = torch.zeros(len(mine), info.world_size, dtype=torch.float64, device=info.device)
    per_rank[:, info.rank] = torch.tensor(list(mine.values()), dtype=torch.float64)
    all_reduce_(per_rank)  # each rank filled its own column: the sum gathers them
    out = {}
    for name, values in zip(mine, per_rank.tolist()):
        out[name] = max(values)
        out.update({f"{name}/{r}": v for r, v in enumerate(values)})
        if info.is_main:
            log.info("%s per rank: %s", name, " ".join(f"{v:.3f}" for v in values))
    return out
