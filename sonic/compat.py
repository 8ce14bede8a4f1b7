"""The one module that touches private or version-dependent torch APIs.

Sonic supports torch >= MIN_TORCH (the oldest torch our GPU machines and many clusters run).
Everything here imports its private symbol lazily, inside the function that needs it, so that
importing Sonic never fails on a torch that lacks one: the feature that needs it fails instead,
when it is configured, with a ValueError that names the feature, the torch it needs and the
torch installed (`require`).

| feature                        | private API                                          | torch  |
|--------------------------------|------------------------------------------------------|--------|
| expert parallelism (ep > 1)    | FSDP-2 ShardPlacementResult, _get_mesh_info          | 2.13   |
|                                | DeviceMesh._unflatten                                | 2.9    |
| activation checkpointing       | checkpoint_wrapper (algorithms._checkpoint)          | all    |
| traceable collectives          | distributed._functional_collectives                  | all    |
| recompute detection (routing)  | torch._C._current_graph_task_id                      | all    |
| pytrees of our dataclasses     | torch.utils._pytree.register_dataclass               | all    |
| checkpoint finiteness check    | torch._foreach_norm                                  | all    |
| norms of bf16 grads and weights| torch._foreach_norm(dtype=float32)                   | all    |
| optim.implementation=triton    | torch._foreach_add_ (the step counts)                | all    |
| grouped_mm baseline backend    | torch._grouped_mm                                    | 2.8    |
"""
from __future__ import annotations

import importlib

import torch

MIN_TORCH = (2, 11)

# feature -> (what it is, the torch it needs, the (module, attribute) pairs it uses)
FEATURES = {
    "expert_parallel": ("FSDP-2 per-parameter meshes", "2.13", (
        ("torch.distributed.fsdp._fully_shard._fsdp_common", "ShardPlacementResult"),
        ("torch.distributed.fsdp._fully_shard._fsdp_init", "_get_mesh_info"),
        ("torch.distributed.device_mesh", "DeviceMesh._unflatten"))),
    "grouped_mm": ("torch._grouped_mm", "2.8", (("torch", "_grouped_mm"),)),
}


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def check_torch() -> None:
    """A ValueError on a torch older than the oldest Sonic supports."""
    if torch_version() < MIN_TORCH:
        raise ValueError(f"Sonic needs torch>={'.'.join(map(str, MIN_TORCH))}; this is {torch.__version__}. "
                         f"Install a newer torch (pip install 'torch>={'.'.join(map(str, MIN_TORCH))}')")


def _lookup(module: str, attr: str):
    """module.attr (attr may be dotted), or None where this torch lacks either."""
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def missing(feature: str) -> str | None:
    """None if this torch has everything `feature` uses; otherwise what it lacks, for a message."""
    _, version, symbols = FEATURES[feature]
    gone = [f"{module}.{attr}" for module, attr in symbols if _lookup(module, attr) is None]
    return ", ".join(gone) or None


def require(feature: str, setting: str) -> None:
    """A ValueError when `setting` (the config that asks for `feature`) cannot run on this torch."""
    lacking = missing(feature)
    if lacking is not None:
        what, version, _ = FEATURES[feature]
        raise ValueError(f"{setting} needs torch>={version} ({what}); this is {torch.__version__} "
                         f"(it lacks {lacking}). Upgrade torch, or leave {setting.split('=')[0]} at its default")


# ---- expert parallelism (FSDP-2 per-parameter meshes) ------------------------------------------------------

def fsdp_mesh_placement(mesh):
    """placement -> FSDP-2's per-parameter placement on `mesh` (torch >= 2.13). FSDP wants one mesh-info
    object for all the parameters of a mesh, so it is made once, here."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    mesh_info = _get_mesh_info(mesh)
    return lambda placement: ShardPlacementResult(placement=placement, mesh_info=mesh_info)


def unflatten_mesh(mesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]):
    return mesh._unflatten(dim, sizes, names)


# ---- used on every torch we support ------------------------------------------------------------------------

def checkpoint_wrapper(module: torch.nn.Module, **kwargs) -> torch.nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, **kwargs)


def functional_all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """A traceable all-reduce (torch.compile keeps it in the graph; no host sync)."""
    from torch.distributed._functional_collectives import all_reduce

    return all_reduce(t, op, group)


def all_to_all_single_autograd(t: torch.Tensor, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a

    return a2a(t, output_split_sizes, input_split_sizes, group)


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. activation checkpointing re-running a forward)."""
    return torch._C._current_graph_task_id() != -1


def register_pytree_dataclass(cls: type) -> type:
    """Make a dataclass a pytree, so FSDP, compile and autograd utilities see the tensors inside."""
    import torch.utils._pytree as pytree

    pytree.register_dataclass(cls)
    return cls


def foreach_max_abs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's max |x| in one multi-tensor launch."""
    return torch._foreach_norm(tensors, float("inf"))


def foreach_norm_fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norm, summed and returned in fp32 whatever its dtype, in one multi-tensor launch."""
    return torch._foreach_norm(tensors, 2, dtype=torch.float32)


def foreach_add_(tensors: list[torch.Tensor], other: torch.Tensor) -> None:
    """Add the 0-d tensor `other` to every tensor in place, in one multi-tensor launch. The list overload: the
    one that takes `other` alone reads it on the host (a sync on CUDA)."""
    torch._foreach_add_(tensors, [other] * len(tensors))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)
