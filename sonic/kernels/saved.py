"""What every backend's autograd Function keeps between forward and backward, stated once.

The paper's memory contract: X, the pre-activation H, the weights and the routing plan (its
scores and integer metadata). Never Y or A: backward recomputes A from H and gets dS from
<dO W2^T, A>. The plan travels as tensors so autograd can save it.
"""
from __future__ import annotations

from sonic.routing.plan import RoutingPlan


def save(ctx, x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, scores_R, meta) -> None:
    ctx.save_for_backward(x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, scores_R, *meta)
    ctx.num_meta = len(meta)  # saved_tensors may be read once only (activation checkpointing)


def restore(ctx) -> tuple:
    """(x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, plan) as `save` kept them."""
    x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, scores_R, *meta = ctx.saved_tensors
    return x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, RoutingPlan.from_metadata(scores_R, meta)


def grads(ctx, dx_TD, dw1, dw2, db1, db2, ds_R) -> tuple:
    """backward's return: one gradient per forward input, None for the plan's metadata tensors."""
    return (dx_TD, dw1, dw2, db1, db2, ds_R) + (None,) * ctx.num_meta
