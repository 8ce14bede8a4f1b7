"""The CuTe-DSL SonicMoE forward / backward (run as the sonic::experts custom op, sonic/kernels/op.py): the
reference's semantics with 8 fused kernels.

forward   1. up-proj   H, A = SwiGLU(X[pi] W1^T)        gathered A operand, SwiGLU epilogue
          2. down-proj Y = A W2^T                         contiguous rows
          3. O = gather-sum of s * Y                      per token, no atomics
backward  4. dH        dA' = dO[pi] W2 -> dH, A', dS      fused dSwiGLU epilogue
          5. dW2       varlen-K  dO[pi]^T A'              gathered operand
          6. dX~       dH W1
          7. dW1       varlen-K  dH^T X[pi]               gathered operand
          8. dX = gather-sum of dX~

The op saves X, H and the plan (with the weights), exactly what it saves for the reference.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sonic.kernels import op
from sonic.kernels.cute import check_inputs, ops
from sonic.kernels.cute.gemm import GemmSpec
from sonic.routing.plan import RoutingPlan

TILE_K = GemmSpec.tile_k  # rows per K tile of the varlen-K (dW) GEMMs


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The backward's intermediate buffers (tests poison them to catch rows that are read but never written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def forward(x_TD, w1_EFD, w2_EDN, b1_EF, b2_ED, plan: RoutingPlan) -> tuple[Tensor, Tensor]:
    tok, off = plan.token_idx_R, plan.expert_offsets_E1
    h_RF, a_RN = ops.up_proj(x_TD, w1_EFD, tok, off)
    y_RD = ops.down_proj(a_RN, w2_EDN, off, tok)
    return ops.gather_sum(y_RD, plan.token_offsets_T1, plan.rows_by_token_R, plan.scores_R), h_RF


def backward(dout_TD, x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, plan: RoutingPlan, needs) -> tuple:
    scores_R, tok, off = plan.scores_R, plan.token_idx_R, plan.expert_offsets_E1
    E = w1_EFD.shape[0]
    dout_TD = dout_TD.to(x_TD.dtype).contiguous()
    dh_RF, ap_RN, ds_R = ops.dh(dout_TD, w2_EDN, h_RF, scores_R, tok, off, out=_dh_buffers(h_RF, w2_EDN, off))
    dw2 = ops.dw2(dout_TD, ap_RN, tok, off, E)
    dxt_RD = ops.dx_rows(dh_RF, w1_EFD, off, tok)
    dw1 = ops.dw1(dh_RF, x_TD, tok, off, E)
    dx_TD = ops.gather_sum(dxt_RD, plan.token_offsets_T1, plan.rows_by_token_R)
    return dx_TD, dw1, dw2, None, None, ds_R.to(scores_R.dtype)


def _dh_buffers(h_RF: Tensor, w2_EDN: Tensor, off_E1: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dh's outputs, with the TILE_K rows after the live ones zeroed. The dW GEMMs read dH and A' in
    TILE_K-row tiles along K, and a padded plan's (sonic/routing/plan.py) last live tile reaches into its
    padding rows, which no kernel writes: garbage there times the zero-filled gathered operand could be
    NaN. The buffers get TILE_K spare rows, so this works whether or not the plan has padding."""
    (R, F), (_, D, N), dev = h_RF.shape, w2_EDN.shape, h_RF.device
    dh_PF, ap_PN = _alloc((R + TILE_K, F), h_RF.dtype, dev), _alloc((R + TILE_K, N), h_RF.dtype, dev)
    after_live = off_E1[-1:].long() + torch.arange(TILE_K, device=dev)
    dh_PF.index_fill_(0, after_live, 0)
    ap_PN.index_fill_(0, after_live, 0)
    return dh_PF[:R], ap_PN[:R], _alloc((-(-N // ops.dh_tile_n(D, N)), R), torch.float32, dev)


def experts(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
            b1_EF: Tensor | None = None, b2_ED: Tensor | None = None) -> Tensor:
    check_inputs(x_TD, w1_EFD, w2_EDN, plan, b1_EF, b2_ED)
    return op.experts(x_TD.contiguous(), w1_EFD.contiguous(), w2_EDN.contiguous(), plan, b1_EF, b2_ED,
                      backend="cute")
