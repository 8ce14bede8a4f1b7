"""grouped_mm backend: the torchtitan-style baseline on `torch._grouped_mm`, plain autograd.

It materialises the gathered X (R x D), keeps H, A and Y for backward through autograd,
and scatters the weighted Y back with index_add_: the layer the benchmark compares the
fused backends against. Same semantics as the reference (H rounded to the input dtype
before SwiGLU, scores applied in fp32).
"""
from __future__ import annotations

import torch
from torch import Tensor

from sonic import compat
from sonic.kernels.swiglu import swiglu
from sonic.routing.plan import RoutingPlan


def unavailable_reason(device: torch.device) -> str | None:
    lacking = compat.missing("grouped_mm")
    if lacking is not None:
        return f"torch {torch.__version__} has no {lacking} (needs >= 2.8)"
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"torch._grouped_mm needs compute capability >= 8.0, got {major}.{minor}"
    return None


def experts(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
            b1_EF: Tensor | None = None, b2_ED: Tensor | None = None) -> Tensor:
    tok = plan.token_idx_R.long()
    E, R = w1_EFD.shape[0], plan.num_rows
    # A padded plan's padding rows (sonic/routing/plan.py: token 0, gate 0) run as rows of the last expert.
    # _grouped_mm leaves rows past its last group unwritten, in forward and backward; this keeps them finite
    # without a masking pass over R x D, and the masked gate gives them no output and no gradient.
    ends_E = plan.expert_offsets_E1[1:].clone()  # _grouped_mm takes each group's end row
    ends_E[-1] = R
    expert_R = plan.expert_idx_R.long().clamp(max=E - 1)
    gate_R = torch.where(plan.expert_idx_R < E, plan.scores_R, torch.zeros_like(plan.scores_R))
    x_RD = x_TD[tok]  # materialised gather
    h_RF = compat.grouped_mm(x_RD, w1_EFD.transpose(-2, -1), ends_E)
    if b1_EF is not None:  # biases gathered in fp32 so that their gradient sums in fp32
        h_RF = (h_RF.float() + b1_EF.float()[expert_R]).to(x_TD.dtype)
    a_RN = swiglu(h_RF).to(x_TD.dtype)
    y_RD = compat.grouped_mm(a_RN, w2_EDN.transpose(-2, -1), ends_E)
    if b2_ED is not None:
        y_RD = (y_RD.float() + b2_ED.float()[expert_R]).to(x_TD.dtype)
    weighted_RD = (y_RD.float() * gate_R.float()[:, None]).to(x_TD.dtype)
    return torch.zeros_like(x_TD).index_add_(0, tok, weighted_RD)
