"""Reference backend: the SonicMoE forward/backward in plain PyTorch (CPU or GPU).

It defines the semantics every fast backend must match, with the paper's decomposition:

  forward   1. H_e = X[pi_e] W1_e^T (+b1)   A_e = SwiGLU(H_e)      (gather fused, H kept)
            2. Y_e = A_e W2_e^T (+b2)                              (contiguous rows)
            3. O_t = sum_rows(t) s_r * Y_r                         (per-token gather-sum)
  backward  4. dA'_e = dO[pi_e] W2_e   dS = <dA', A> (+<dO, b2>)   dA = s*dA'
               dH = dSwiGLU(dA, H)     A' = s*A                    (dH kernel)
            5. dW2_e = dO[pi_e]^T A'   6. dX~_e = dH_e W1_e   7. dW1_e = dH_e^T X[pi_e]
            8. dX_t = sum_rows(t) dX~_r                            (per-token gather-sum)

It runs as the sonic::experts custom op (sonic/kernels/op.py), which saves X, H and the plan.
A, Y, the gathered X and the gathered dO are recomputed or streamed, never saved.

Legend: T tokens, D hidden, N expert width, F = 2N (gate/up interleaved), E experts,
R routed rows.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sonic.kernels import op
from sonic.kernels.swiglu import acc, dswiglu, swiglu
from sonic.routing.plan import RoutingPlan


def unavailable_reason(device: torch.device) -> str | None:
    return None  # runs anywhere PyTorch runs


def gather_sum(rows_RD: Tensor, plan: RoutingPlan, weight_R: Tensor | None = None) -> Tensor:
    """out_t = sum over token t's rows of (weight_r *) rows_r, accumulated in fp32 (fp64 for fp64)."""
    T, D = plan.num_tokens, rows_RD.shape[1]
    vals = acc(rows_RD) if weight_R is None else acc(rows_RD) * acc(weight_R)[:, None]
    out = vals.new_zeros(T, D)
    # rows grouped by token: index_add_ over a token-sorted sequence is deterministic on CPU
    # and sums each token's rows in the same order as the fast kernels. The live rows only: a padded
    # plan's padding rows (sonic/routing/plan.py) come last and hold whatever the caller left there.
    by_token = plan.rows_by_token_R[: plan.live_rows()].long()
    return out.index_add_(0, plan.token_idx_R.long()[by_token], vals[by_token])


def _segments(plan: RoutingPlan) -> list[tuple[int, int, int]]:
    off = plan.expert_offsets_E1.tolist()
    return [(e, off[e], off[e + 1]) for e in range(len(off) - 1) if off[e + 1] > off[e]]


def forward(x_TD, w1_EFD, w2_EDN, b1_EF, b2_ED, plan: RoutingPlan) -> tuple[Tensor, Tensor]:
    """(out_TD, h_RF): the forward of sonic::experts (sonic/kernels/op.py)."""
    R, F, D = plan.num_rows, w1_EFD.shape[1], x_TD.shape[1]
    h_RF = x_TD.new_empty(R, F)
    y_RD = x_TD.new_empty(R, D)
    tok = plan.token_idx_R.long()
    for e, lo, hi in _segments(plan):
        h = x_TD[tok[lo:hi]] @ w1_EFD[e].T
        if b1_EF is not None:
            h = h + b1_EF[e]
        h_RF[lo:hi] = h
        a = swiglu(h_RF[lo:hi]).to(x_TD.dtype)
        y = a @ w2_EDN[e].T
        y_RD[lo:hi] = y if b2_ED is None else y + b2_ED[e]
    return gather_sum(y_RD, plan, plan.scores_R).to(x_TD.dtype), h_RF


def backward(dout_TD, x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, plan: RoutingPlan, needs) -> tuple:
    """(dx, dw1, dw2, db1, db2, ds): the backward of sonic::experts; every gradient is computed (the
    reference is for correctness, not speed), `needs` is the op's contract with the fast backends."""
    scores_R, token_idx_R = plan.scores_R, plan.token_idx_R
    dt = x_TD.dtype
    R = token_idx_R.numel()
    tok = token_idx_R.long()
    dout_TD = dout_TD.to(dt)
    ds_R = acc(scores_R).new_zeros(R)
    dxt_RD = x_TD.new_empty(R, x_TD.shape[1])
    dw1 = acc(w1_EFD).new_zeros(w1_EFD.shape)
    dw2 = acc(w2_EDN).new_zeros(w2_EDN.shape)
    db1 = None if b1_EF is None else acc(b1_EF).new_zeros(b1_EF.shape)
    db2 = None if b2_ED is None else acc(b2_ED).new_zeros(b2_ED.shape)
    for e, lo, hi in _segments(plan):
        do = dout_TD[tok[lo:hi]]  # gathered dO, streamed
        s = scores_R[lo:hi, None]
        h = h_RF[lo:hi]
        a = swiglu(h)  # recomputed from H, fp32
        da_prime = acc(do @ w2_EDN[e])  # dA' = dO W2
        ds = (da_prime * a).sum(-1)
        if b2_ED is not None:
            ds = ds + (acc(do) * acc(b2_ED[e])).sum(-1)
            db2[e] = (s * acc(do)).sum(0)
        ds_R[lo:hi] = ds
        dh = dswiglu(s * da_prime, h).to(dt)
        a_prime = (s * a).to(dt)
        dw2[e] = acc(do.T @ a_prime)
        dxt_RD[lo:hi] = dh @ w1_EFD[e]
        dw1[e] = acc(dh.T @ x_TD[tok[lo:hi]])
        if b1_EF is not None:
            db1[e] = acc(dh).sum(0)
    dx_TD = gather_sum(dxt_RD, plan).to(dt)
    cast = lambda g, ref: None if g is None else g.to(ref.dtype)  # noqa: E731
    return dx_TD, cast(dw1, w1_EFD), cast(dw2, w2_EDN), cast(db1, b1_EF), cast(db2, b2_ED), ds_R.to(scores_R.dtype)


def experts(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
            b1_EF: Tensor | None = None, b2_ED: Tensor | None = None) -> Tensor:
    return op.experts(x_TD, w1_EFD, w2_EDN, plan, b1_EF, b2_ED, backend="reference")
