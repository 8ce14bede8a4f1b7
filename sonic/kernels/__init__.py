"""Expert computation: `experts(x_TD, w1_EFD, w2_EDN, plan) -> out_TD` for several backends.

Backends are one Registry (sonic/registry.py), chosen here and only here by model.moe.kernel_backend.
Every backend module exposes `experts(...)` with the reference semantics and
`unavailable_reason(device) -> str | None`, and sets `SUPPORTS_BIAS = False` if it cannot take expert
biases. The SonicMoE backends (reference, triton, cute) also expose `forward` and `backward`: their
`experts` runs as the sonic::experts custom op (sonic/kernels/op.py), one op that torch.compile keeps
in its graph, saving only X, H and the plan.

| name       | what                                                           |
|------------|----------------------------------------------------------------|
| reference  | SonicMoE algorithm in plain PyTorch (CPU/GPU); the semantics   |
| triton     | fused IO-aware Triton kernels, any recent CUDA GPU             |
| cute       | CuTe-DSL TMA + wgmma kernels, Hopper (sm_90)                   |
| naive      | per-expert loop under autograd (caches everything); baseline   |
| grouped_mm | torchtitan-style `torch._grouped_mm`; baseline                 |
| auto       | first available of cute, triton, reference                     |
"""
from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch
from torch import Tensor

from sonic.registry import Entry, Registry
from sonic.routing.plan import RoutingPlan

BACKENDS = Registry("model.moe.kernel_backend", [
    Entry("reference", "sonic.kernels.reference"),
    Entry("triton", "sonic.kernels.triton", package="triton", extra="triton (the 'gpu' extra)"),
    Entry("cute", "sonic.kernels.cute", package="cutlass", extra="'nvidia-cutlass-dsl>=4.8' (the 'gpu' extra)"),
    Entry("naive", "sonic.kernels.naive"),
    Entry("grouped_mm", "sonic.kernels.grouped_mm"),
])
AUTO_ORDER = ("cute", "triton", "reference")

ExpertsFn = Callable[..., Tensor]


def _why_unavailable(name: str, device: torch.device, bias: bool) -> str | None:
    # every backend module imports without its optional package, so the device's reason comes first
    module = importlib.import_module(BACKENDS.entries[name].target)
    if bias and not getattr(module, "SUPPORTS_BIAS", True):
        return "it has no expert-bias kernels (model.moe.expert_bias=true)"
    return module.unavailable_reason(device) or BACKENDS.missing(name)


@functools.lru_cache(maxsize=None)
def resolve_backend(name: str, device: torch.device, bias: bool = False) -> str:
    """Map a requested backend (or 'auto') to a runnable one on `device`."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            if _why_unavailable(candidate, device, bias) is None:
                return candidate
        raise AssertionError("the reference backend runs everywhere")
    BACKENDS.check(name, ("auto",))
    reason = _why_unavailable(name, device, bias)
    if reason is not None:
        raise ValueError(f"kernel_backend {name!r} cannot run on {device}: {reason}. "
                         f"Use kernel_backend=auto or reference.")
    return name


def get_experts_fn(name: str, device: torch.device, bias: bool = False) -> ExpertsFn:
    return BACKENDS.load(resolve_backend(name, torch.device(device), bias)).experts


def experts(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
            b1_EF: Tensor | None = None, b2_ED: Tensor | None = None, backend: str = "auto") -> Tensor:
    """out_TD = sum over each token's routed rows of score * SwiGLU-expert(x)."""
    bias = b1_EF is not None or b2_ED is not None
    return get_experts_fn(backend, x_TD.device, bias)(x_TD, w1_EFD, w2_EDN, plan, b1_EF, b2_ED)
