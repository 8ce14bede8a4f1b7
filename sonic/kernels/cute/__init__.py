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


def experts(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
            b1_EF: Tensor | None = None, b2_ED: Tensor | None = None) -> Tensor:
    reason = unavailable_reason(x_TD.device)
    if reason is not None:
        raise ValueError(f"kernel_backend 'cute' cannot run: {reason}")
    from sonic.kernels.cute.function import experts as _experts

    return _experts(x_TD, w1_EFD, w2_EDN, plan, b1_EF, b2_ED)
