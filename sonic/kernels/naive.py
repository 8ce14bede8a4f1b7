"""Naive backend: per-expert loop under plain autograd.

The ground truth for gradient tests (run it in float64) and the baseline for activation
memory: autograd keeps the gathered X, H, A and Y of every expert, as ScatterMoE-like
implementations do.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sonic.kernels.swiglu import swiglu
from sonic.routing.plan import RoutingPlan


def unavailable_reason(device: torch.device) -> str | None:
    return None


def experts(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
            b1_EF: Tensor | None = None, b2_ED: Tensor | None = None) -> Tensor:
    out_TD = torch.zeros_like(x_TD)
    off = plan.expert_offsets_E1.tolist()
    for e in range(len(off) - 1):
        lo, hi = off[e], off[e + 1]
        if hi == lo:
            continue
        tok = plan.token_idx_R[lo:hi].long()
        h = x_TD[tok] @ w1_EFD[e].T
        if b1_EF is not None:
            h = h + b1_EF[e]
        y = swiglu(h).to(x_TD.dtype) @ w2_EDN[e].T
        if b2_ED is not None:
            y = y + b2_ED[e]
        out_TD = out_TD.index_add(0, tok, (y * plan.scores_R[lo:hi, None]).to(x_TD.dtype))
    return out_TD
