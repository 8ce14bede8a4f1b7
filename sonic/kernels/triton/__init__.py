"""Triton backend: the SonicMoE forward/backward as fused, IO-aware Triton kernels.

Same semantics as `sonic.kernels.reference` (which see), with the paper's 8 kernels:

  forward   up-proj (gather X in the loads, SwiGLU epilogue, writes H and A),
            down-proj (contiguous Y), aggregation (per-token gather-sum)
  backward  dH (gathered dO x W2, dS / dSwiGLU / A' = s*A epilogue), dW2 and dW1
            (varlen-K, gathered operand in the loads), dX~ (varlen-M), dX (gather-sum)

Only X, H and the plan are saved for backward. No kernel needs the routed-row count on
the host: every grid is an upper bound read from tensor shapes, and each program looks
its (expert, row tile) up in device metadata. See README.md beside this file.

This module imports without Triton so that `unavailable_reason` can say why it is missing.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from sonic.routing.plan import RoutingPlan


MIN_TRITON = (3, 4)  # host TensorDescriptors and tl.range(flatten=), which the TMA kernels use (gemm.py)


def version_reason(version: str) -> str | None:
    """Why this Triton version cannot run the backend, or None. Older ones fail at import of gemm.py."""
    try:
        have = tuple(int(v) for v in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None  # a development build: let the import decide
    if have < MIN_TRITON:
        need = ".".join(map(str, MIN_TRITON))
        return (f"triton {version} is older than {need}, which the triton backend's TMA kernels need; "
                f"pip install 'triton>={need}' (or the 'gpu' extra)")
    return None


def unavailable_reason(device: torch.device) -> str | None:
    device = torch.device(device)
    if device.type != "cuda":
        return f"the triton backend needs a CUDA device, got {device.type!r}"
    if not torch.cuda.is_available():
        return "torch reports no usable CUDA device"
    try:
        import triton
    except ImportError as err:
        return f"triton is not importable ({err}); install the 'gpu' extra"
    old = version_reason(triton.__version__)
    if old:
        return old
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"compute capability {major}.{minor} < 8.0 (no bf16 tensor cores)"
    return None


def launch(kernel, grid):
    """kernel[grid], as a callable. While torch traces the call (its tensors are fake or functional: the body of a
    traced op, sonic/ops.py, under torch.compile), through torch.library.wrap_triton, so that inductor launches the
    kernel from its own generated code. A plain launch otherwise: eager calls keep Triton's launcher, with no dispatch
    through wrap_triton's higher-order op."""
    def run(*args, **kwargs):
        traced = any(type(a) not in (Tensor, torch.nn.Parameter) for a in args if isinstance(a, Tensor))
        return (torch.library.wrap_triton(kernel) if traced else kernel)[grid](*args, **kwargs)

    return run


def forward(*args):
    from sonic.kernels.triton.function import forward as _forward  # needs triton

    return _forward(*args)


def backward(*args):
    from sonic.kernels.triton.function import backward as _backward  # needs triton

    return _backward(*args)


def experts(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
            b1_EF: Tensor | None = None, b2_ED: Tensor | None = None) -> Tensor:
    # the registry checks the rest (unavailable_reason) once; TRITON_INTERPRET=1 runs on the CPU
    if x_TD.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the triton backend needs CUDA tensors, got x_TD on {x_TD.device}; "
                         f"use kernel_backend=reference (or auto) on {x_TD.device.type}")
    from sonic.kernels.triton.function import experts as _experts  # needs triton

    return _experts(x_TD, w1_EFD, w2_EDN, plan, b1_EF, b2_ED)
