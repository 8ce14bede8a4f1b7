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

from torch import Tensor

from sonic.kernels import op
from sonic.kernels.cute import check_inputs, ops
from sonic.routing.plan import RoutingPlan


def forward(x_TD, w1_EFD, w2_EDN, b1_EF, b2_ED, plan: RoutingPlan) -> tuple[Tensor, Tensor]:
    tok, off = plan.token_idx_R, plan.expert_offsets_E1
    h_RF, a_RN = ops.up_proj(x_TD, w1_EFD, tok, off)
    y_RD = ops.down_proj(a_RN, w2_EDN, off, tok)
    return ops.gather_sum(y_RD, plan.token_offsets_T1, plan.rows_by_token_R, plan.scores_R), h_RF


def backward(dout_TD, x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, plan: RoutingPlan, needs) -> tuple:
    scores_R, tok, off = plan.scores_R, plan.token_idx_R, plan.expert_offsets_E1
    E = w1_EFD.shape[0]
    dout_TD = dout_TD.to(x_TD.dtype).contiguous()
    dh_RF, ap_RN, ds_R = ops.dh(dout_TD, w2_EDN, h_RF, scores_R, tok, off)
    dw2 = ops.dw2(dout_TD, ap_RN, tok, off, E)
    dxt_RD = ops.dx_rows(dh_RF, w1_EFD, off, tok)
    dw1 = ops.dw1(dh_RF, x_TD, tok, off, E)
    dx_TD = ops.gather_sum(dxt_RD, plan.token_offsets_T1, plan.rows_by_token_R)
    return dx_TD, dw1, dw2, None, None, ds_R.to(scores_R.dtype)


def experts(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
            b1_EF: Tensor | None = None, b2_ED: Tensor | None = None) -> Tensor:
    check_inputs(x_TD, w1_EFD, w2_EDN, plan, b1_EF, b2_ED)
    return op.experts(x_TD.contiguous(), w1_EFD.contiguous(), w2_EDN.contiguous(), plan, b1_EF, b2_ED,
                      backend="cute")
