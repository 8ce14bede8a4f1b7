"""CuTe-DSL Hopper backend: TMA + wgmma grouped GEMMs with fused SonicMoE epilogues.

Importing this package never imports cutlass: the registry and the CPU test-suite work
without nvidia-cutlass-dsl. The kernels load on first use. See README.md beside this file.
"""
from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

from sonic.routing.plan import RoutingPlan

MIN_CUTLASS_DSL = (4, 8)


@functools.lru_cache(maxsize=None)
def _cutlass_reason() -> str | None:
    if importlib.util.find_spec("cutlass") is None:
        return "nvidia-cutlass-dsl is not installed (pip install 'nvidia-cutlass-dsl>=4.8')"
    try:
        import cutlass
    except Exception as err:  # a broken install must not take the registry down
        return f"nvidia-cutlass-dsl failed to import ({err})"
    version = tuple(int(p) for p in cutlass.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_CUTLASS_DSL:
        return f"nvidia-cutlass-dsl {cutlass.__version__} is too old; need >= 4.8"
    return None


SUPPORTS_BIAS = False  # expert biases are not fused yet; `auto` then picks triton


def unavailable_reason(device: torch.device) -> str | None:
    """None on an sm_90 GPU with CuTe DSL importable; otherwise why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the cute backend runs on CUDA GPUs only (device is {device.type})"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return (f"the cute kernels use sm_90a wgmma/TMA and need a Hopper GPU (compute "
                f"capability 9.0); this device is sm_{major}{minor}")
    return _cutlass_reason()


def check_inputs(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
                 b1_EF: Tensor | None = None, b2_ED: Tensor | None = None) -> None:
    """What the cute kernels cannot take, as ValueErrors that say what to change.

    Shapes and dtypes only, so it runs (and is tested) without cutlass or a GPU. TMA
    descriptors and the 16-byte vector loads/stores need 16-byte aligned rows and base
    pointers: d and n multiples of 8 (bf16/fp16), tensors not offset by a partial row.
    """
    if b1_EF is not None or b2_ED is not None:
        raise ValueError("the cute backend does not fuse expert biases; keep biases out of the "
                         "experts (DESIGN.md) or use kernel_backend=triton/reference")
    if x_TD.dim() != 2 or w1_EFD.dim() != 3 or w2_EDN.dim() != 3:
        raise ValueError(f"the cute backend takes x_TD (T, d), w1_EFD (E, 2n, d), w2_EDN (E, d, n); got "
                         f"{tuple(x_TD.shape)}, {tuple(w1_EFD.shape)}, {tuple(w2_EDN.shape)}")
    if x_TD.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the cute backend runs bf16/fp16 activations, got {x_TD.dtype}; use bf16 autocast "
                         f"or kernel_backend=triton/reference")
    if w1_EFD.dtype != x_TD.dtype or w2_EDN.dtype != x_TD.dtype:
        raise ValueError("the cute backend needs x, w1 and w2 in one dtype "
                         f"(got {x_TD.dtype}, {w1_EFD.dtype}, {w2_EDN.dtype})")
    E, F, D = w1_EFD.shape
    if F % 2 or tuple(w2_EDN.shape) != (E, D, F // 2) or x_TD.shape[1] != D:
        raise ValueError(f"shape mismatch: x {tuple(x_TD.shape)}, w1 {tuple(w1_EFD.shape)}, "
                         f"w2 {tuple(w2_EDN.shape)}")
    N = F // 2
    if D % 8:
        raise ValueError(f"the cute backend needs model.dim % 8 == 0 (TMA and 16-byte rows of bf16), got "
                         f"d={D}; use kernel_backend=triton (any d) or pad model.dim to {D + 8 - D % 8}")
    if N % 8:
        raise ValueError(f"the cute backend needs moe.expert_dim % 8 == 0 (TMA and 16-byte rows of bf16), "
                         f"got n={N}; use kernel_backend=triton (any n) or set moe.expert_dim={N + 8 - N % 8}")
    if plan.num_experts != E or plan.num_tokens != x_TD.shape[0]:
        raise ValueError(f"plan is for {plan.num_tokens} tokens x {plan.num_experts} experts, "
                         f"inputs have {x_TD.shape[0]} x {E}")
    # x, w1 and w2 are made contiguous (a fresh, aligned copy if they are not) before the launch and
    # the scores go through .float().contiguous(); the plan's index tensors go to the kernels as they are
    named = [("x_TD", x_TD), ("w1_EFD", w1_EFD), ("w2_EDN", w2_EDN)]
    named += [(f"plan.{n}", t) for n, t in zip(("token_idx_R", "expert_idx_R", "expert_offsets_E1",
                                                 "token_offsets_T1", "rows_by_token_R"), plan.metadata())]
    for name, t in named if not torch.compiler.is_compiling() else ():  # data_ptr: eager only
        if name.startswith("plan.") and not t.is_contiguous():
            raise ValueError(f"the cute backend needs contiguous plan tensors; {name} has strides "
                             f"{t.stride()}: build the plan with sonic.routing.plan.build_plan")
        if t.is_contiguous() and t.numel() and t.data_ptr() % 16:
            raise ValueError(f"the cute backend needs 16-byte aligned tensors (TMA), {name} starts "
                             f"{t.data_ptr() % 16} bytes past a boundary; pass a fresh tensor ({name}.clone())")


def forward(*args):
    from sonic.kernels.cute.function import forward as _forward  # needs cutlass

    return _forward(*args)


def backward(*args):
    from sonic.kernels.cute.function import backward as _backward  # needs cutlass

    return _backward(*args)


def experts(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
            b1_EF: Tensor | None = None, b2_ED: Tensor | None = None) -> Tensor:
    # The registry checked unavailable_reason when it resolved the backend. Checking it again here broke every
    # compiled block's graph (find_spec is not traceable): five graphs per layer, each with its own host overhead.
    if x_TD.device.type != "cuda":
        raise ValueError(f"the cute backend needs CUDA tensors, got x_TD on {x_TD.device}; "
                         f"use kernel_backend=reference (or auto) on {x_TD.device.type}")
    from sonic.kernels.cute.function import experts as _experts  # needs cutlass

    return _experts(x_TD, w1_EFD, w2_EDN, plan, b1_EF, b2_ED)
