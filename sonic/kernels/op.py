"""The MoE experts as one torch.library custom op per direction, whatever the backend.

  sonic::experts           (x, w1, w2, b1?, b2?, plan tensors, backend) -> (out_TD, h_RF)
  sonic::experts_backward  (dout, x, h, w1, w2, b1?, b2?, plan tensors, backend, needs) -> the six grads

Each SonicMoE backend (reference | triton | cute) is an implementation behind them: its module has
`forward(x_TD, w1_EFD, w2_EDN, b1_EF, b2_ED, plan) -> (out_TD, h_RF)` and
`backward(dout_TD, x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, plan, needs) -> (dx, dw1, dw2, db1, db2, ds)`
(None for a gradient not needed). The backward is registered with `register_autograd`, and the fake
implementations give the shapes, so torch.compile keeps a whole MoE block in its graph: it sees one
opaque op, and a changing routed-row count R is a size, not a recompile.

The paper's memory contract, stated once here: forward keeps X, the pre-activation H, the weights and
the routing plan (its scores and integer metadata) for backward. Never Y or A: backward recomputes A
from H and gets dS from <dO W2^T, A>. H travels out of the forward op as its second output only so
that autograd can keep it; the caller sees out_TD alone.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sonic.kernels import BACKENDS
from sonic.routing.plan import RoutingPlan

NEEDS = ("dx", "dw1", "dw2", "db1", "db2", "ds")


def _impl(backend: str):
    return BACKENDS.load(backend)


def _plan(scores_R: Tensor, meta: tuple[Tensor, ...]) -> RoutingPlan:
    return RoutingPlan.from_metadata(scores_R, meta)


@torch.library.custom_op("sonic::experts", mutates_args=())
def _experts(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, b1_EF: Tensor | None, b2_ED: Tensor | None,
             scores_R: Tensor, token_idx_R: Tensor, expert_idx_R: Tensor, expert_offsets_E1: Tensor,
             token_offsets_T1: Tensor, rows_by_token_R: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    plan = _plan(scores_R, (token_idx_R, expert_idx_R, expert_offsets_E1, token_offsets_T1, rows_by_token_R))
    return _impl(backend).forward(x_TD, w1_EFD, w2_EDN, b1_EF, b2_ED, plan)


@_experts.register_fake
def _(x_TD, w1_EFD, w2_EDN, b1_EF, b2_ED, scores_R, token_idx_R, *rest):
    return x_TD.new_empty(x_TD.shape), x_TD.new_empty((token_idx_R.shape[0], w1_EFD.shape[1]))


@torch.library.custom_op("sonic::experts_backward", mutates_args=())
def _experts_backward(dout_TD: Tensor, x_TD: Tensor, h_RF: Tensor, w1_EFD: Tensor, w2_EDN: Tensor,
                      b1_EF: Tensor | None, b2_ED: Tensor | None, scores_R: Tensor, token_idx_R: Tensor,
                      expert_idx_R: Tensor, expert_offsets_E1: Tensor, token_offsets_T1: Tensor,
                      rows_by_token_R: Tensor, backend: str, needs: list[bool]) -> list[Tensor]:
    plan = _plan(scores_R, (token_idx_R, expert_idx_R, expert_offsets_E1, token_offsets_T1, rows_by_token_R))
    grads = _impl(backend).backward(dout_TD, x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, plan, tuple(needs))
    # a custom op returns tensors: an empty one stands for "no gradient" (the autograd wrapper maps it back)
    return [g if g is not None else x_TD.new_empty(0) for g in grads]


@_experts_backward.register_fake
def _(dout_TD, x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, scores_R, *rest):
    *_, needs = rest
    like = (x_TD, w1_EFD, w2_EDN, b1_EF, b2_ED, scores_R)
    return [torch.empty_like(t) if t is not None and need else x_TD.new_empty(0) for t, need in zip(like, needs)]


def _setup(ctx, inputs, output):
    x_TD, w1_EFD, w2_EDN, b1_EF, b2_ED, scores_R, *meta, backend = inputs
    ctx.save_for_backward(x_TD, output[1], w1_EFD, w2_EDN, b1_EF, b2_ED, scores_R, *meta)
    ctx.backend = backend


def _backward(ctx, dout_TD, _dh):
    x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, scores_R, *meta = ctx.saved_tensors
    given = (x_TD, w1_EFD, w2_EDN, b1_EF, b2_ED, scores_R)
    needs = [bool(n) and t is not None for n, t in zip(ctx.needs_input_grad[:6], given)]
    grads = _experts_backward(dout_TD.contiguous(), x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, scores_R, *meta,
                              ctx.backend, needs)
    if needs[5]:  # a padded plan's padding rows (sonic/routing/plan.py) get no gradient, whatever a kernel left there
        expert_idx_R = meta[1]
        grads[5] = torch.where(expert_idx_R < w1_EFD.shape[0], grads[5], torch.zeros_like(grads[5]))
    return (*(g if need else None for g, need in zip(grads, needs)),) + (None,) * (len(meta) + 1)


_experts.register_autograd(_backward, setup_context=_setup)


def experts(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan, b1_EF: Tensor | None,
            b2_ED: Tensor | None, backend: str) -> Tensor:
    """out_TD through the custom op, with `backend`'s kernels (inputs already checked by the backend)."""
    out_TD, _ = _experts(x_TD, w1_EFD, w2_EDN, b1_EF, b2_ED, plan.scores_R, *plan.metadata(), backend)
    return out_TD
