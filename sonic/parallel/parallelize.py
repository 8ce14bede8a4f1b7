"""Apply expert parallelism, torch.compile, activation checkpointing and FSDP-2 to a Transformer.

Order: compile each block, wrap it for activation checkpointing (AC), then fully_shard each
block and finally the root. torchtitan compiles the AC-wrapped block instead; that order
makes dynamo trace the checkpoint as one higher-order op, and an MoE block cannot be traced
whole (the routing plan's row count is data dependent), so dynamo would fall back to eager
for the entire block and compile nothing. Compiling inside the wrapper keeps the graphs
between those breaks compiled, and the recompute in backward re-runs the same compiled code.

Routing on recompute: the wrapper restores the RNG state (stochastic rounding draws the
same numbers) and the router reads its running buffers without updating them while a
backward pass is running (sonic/routing/router.py), so a recomputed forward routes every
token exactly as the original forward did.

Inside forward, FSDP all-gathers each block's parameters into plain unsharded tensors, so
every kernel backend sees ordinary local tensors.

Expert parallelism (parallel.ep > 1, as torchtitan does it): each MoE block's expert weights
become DTensors sharded by expert over the `ep` mesh dimension (MoE.set_process_groups), and FSDP shards them further
over `efsdp` (the data-parallel ranks that hold the same experts) on a non-expert dim; every
other parameter is FSDP over all of dp_shard. The checkpoint then sees full-shape tensors at any
ep. Tokens reach the experts through sonic/models/dispatch.py's all-to-all.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from sonic import compat
from sonic.models.moe import MoE
from sonic.parallel.config import ParallelConfig
from sonic.parallel.distributed import DistInfo

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def expert_shard_dim(shape: torch.Size, shard_size: int) -> int | None:
    """Dim to shard a stacked expert weight (E, ., .) on: 0 (experts) when E divides evenly,
    else the first other dim that does; None (FSDP's padded dim 0) when none does."""
    return next((dim for dim, size in enumerate(shape) if size % shard_size == 0), None)


def _placement_fn(shard_size: int, experts_mesh: DeviceMesh | None):
    """FSDP's placement per parameter. Under EP (experts_mesh set) the ep-sharded expert weights go
    to FSDP over experts_mesh, on the first of dims 1.. that it divides: dim 0 is already split
    by expert, and FSDP splitting it again would need strided shards."""
    on_experts_mesh = compat.fsdp_mesh_placement(experts_mesh) if experts_mesh is not None else None

    def placement(param: nn.Parameter):
        if on_experts_mesh is not None and isinstance(param, DTensor):  # before FSDP only EP made DTensors
            size = experts_mesh.size(experts_mesh.ndim - 1)  # the efsdp dim (after dp_replicate under HSDP)
            dim = next((d for d in range(1, param.dim()) if param.shape[d] % size == 0), None)
            if dim is None:
                raise ValueError(f"no dim of an expert weight {tuple(param.shape)} divides the {size} ranks "
                                 f"that share its experts (world / dp_replicate / ep); raise parallel.ep")
            return on_experts_mesh(Shard(dim))
        if param.dim() < 3:  # only stacked expert weights; the rest is small or evenly split
            return None
        dim = expert_shard_dim(param.shape, shard_size)
        return None if dim is None else Shard(dim)

    return placement


def checkpointed(i: int, cfg: ParallelConfig) -> bool:
    """Whether block i recomputes its activations in backward."""
    return cfg.activation_checkpoint == "full" or (cfg.activation_checkpoint == "selective"
                                                   and i % cfg.ac_every == 0)


def compile_enabled(cfg: ParallelConfig, device: torch.device) -> bool:
    """parallel.compile, where unset on by default on a GPU: per-block compile fuses the norms,
    RoPE and SwiGLU elementwise work (docs/repro/e2e_throughput.md has the measured gain)."""
    return cfg.compile if cfg.compile is not None else device.type == "cuda"


def weights_dtype(cfg: ParallelConfig, info: DistInfo, bf16_step: bool, grad_accum: int = 1) -> torch.dtype | None:
    """The dtype one GPU holds the weights in (fp32 masters in the optimizer with optim.master_weights=fp32,
    `build_optimizer`), or None: keep them fp32. parallel.param_dtype is what the forward and backward read either
    way: FSDP-2 gathers its fp32 shards in it; one GPU has nothing to gather, so it holds the weights in it and saves
    the step's casts of every weight and gradient (and runs the residual stream in it, as under FSDP). None with FSDP, off the GPU,
    where the step runs in fp32 (train.precision), and with train.grad_accum > 1, whose micro-batch gradients
    would then be summed in bf16 (fp32 weights sum them in fp32, as FSDP-2 does)."""
    if info.mesh is not None or info.device.type != "cuda" or not bf16_step or grad_accum > 1:
        return None
    return None if cfg.param_dtype == "fp32" else DTYPES[cfg.param_dtype]


def parallelize(model: nn.Module, cfg: ParallelConfig, info: DistInfo) -> nn.Module:
    layers = model.layers
    compile_blocks = compile_enabled(cfg, info.device)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.resolve_backends(info.device)  # now, not inside the first compiled forward
    for i, block in enumerate(layers):
        if compile_blocks:
            block.compile(backend=cfg.compile_backend)
        if checkpointed(i, cfg):
            block = compat.checkpoint_wrapper(block, preserve_rng_state=True)
        layers[i] = block
    if info.mesh is None:
        return model
    # the aux loss counts expert picks over every data-parallel rank; under EP each block keeps
    # its share of the experts and sends them their tokens over the ep group
    ep_mesh = info.experts_mesh["ep"] if info.experts_mesh is not None else None
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.set_process_groups(stats_group=dist.group.WORLD, ep_mesh=ep_mesh)
    experts_mesh = None
    if info.experts_mesh is not None:
        experts_mesh = info.experts_mesh["efsdp" if cfg.dp_replicate == 1 else ("dp_replicate", "efsdp")]
    mesh = info.mesh if cfg.dp_replicate > 1 else info.mesh["dp_shard"]  # 2-D mesh = HSDP
    on_gpu = info.device.type == "cuda"  # bf16 compute on CPU would only be slow and inexact
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype] if on_gpu else torch.float32,
                              reduce_dtype=DTYPES[cfg.reduce_dtype] if on_gpu else torch.float32)
    placement = _placement_fn(info.mesh["dp_shard"].size(), experts_mesh)
    for i, block in enumerate(layers):
        # The last block's parameters are needed again right at the start of backward.
        reshard = cfg.reshard_after_forward and i < len(layers) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, shard_placement_fn=placement, reshard_after_forward=reshard)
    # The root's parameters (embedding / LM head, final norm) are needed again first thing in
    # backward, so they stay gathered (FSDP's own default for the root). Resharding them would
    # also need FSDP to find the forward's output tensors to hook the re-gather on, and
    # FSDP-2 before torch 2.13 does not look inside our ModelOutput dataclass.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip FSDP's reduce-scatter (and HSDP's all-reduce) on all but the last micro-batch of an
    accumulation: gradients accumulate unsharded locally and are reduced once per step."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
