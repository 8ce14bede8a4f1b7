"""Token choice, the torch routing backend: each token picks its top-K experts; the gates depend on `order`.

Legend: T tokens, E experts, K top-k.

  topk_softmax   gates = softmax over the K picked logits (the SonicMoE default)
  softmax_topk   gates = full softmax over E at the K picks, optionally renormalised to sum 1

Selection and gates are separate on purpose: the selection adds the aux-loss-free expert bias
to the logits, the gates never do (DeepSeek-V3). Ties go to the lower expert index.

This module is the torch routing backend (routing.backend=torch, sonic/routing/backends.py: select_topk,
route_topk, route_token_rounding, and the router's prefix_centred_logits[_backward] and
prefix_standardise[_backward] from sonic/routing/scores.py) and defines the semantics;
sonic/kernels/triton/routing.py is the fused one. Both give a TopK with the statistics the losses need (the
full softmax summed over tokens, and the logsumexp per token), so no loss makes a second pass over T x E.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor

from sonic.routing.plan import RoutingPlan, TopK, plan_from_topk
from sonic.routing.scores import (  # noqa: F401 (its centring and logit norm)
    prefix_centred_logits, prefix_centred_logits_backward, prefix_standardise, prefix_standardise_backward)


def unavailable_reason(device: torch.device) -> str | None:
    return None  # runs wherever torch runs


def select_topk(logits_TE: Tensor, bias_E: Tensor, k: int, order: str, renormalize: bool) -> TopK:
    """Top-K of logits + bias_E per token, gates from the unbiased logits; softmax statistics in fp32
    (fp64 for fp64 logits)."""
    logits_TE = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
    lse_T = logits_TE.logsumexp(-1)
    probs_TE = torch.exp(logits_TE - lse_T[:, None])
    select_TE = logits_TE.detach() + bias_E.to(logits_TE.dtype)
    # a stable descending sort: equal scores keep the lower expert first, as the fused kernel does
    expert_idx_TK = select_TE.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    if order == "topk_softmax":
        gates_TK = logits_TE.gather(1, expert_idx_TK).softmax(-1)
    else:
        assert order == "softmax_topk", order
        gates_TK = probs_TE.gather(1, expert_idx_TK)
        if renormalize:
            gates_TK = gates_TK / gates_TK.sum(-1, keepdim=True)
    return TopK(expert_idx_TK, gates_TK, probs_TE.sum(0), lse_T)


def route_topk(logits_TE: Tensor, bias_E: Tensor, k: int, order: str, renormalize: bool) -> tuple[TopK, RoutingPlan]:
    """select_topk and the plan of its picks."""
    topk = select_topk(logits_TE, bias_E, k, order, renormalize)
    return topk, plan_from_topk(topk.expert_idx_TK, topk.gates_TK, logits_TE.shape[1])


def route_token_rounding(logits_TE: Tensor, bias_E: Tensor, k: int, order: str, renormalize: bool, tile: int,
                         mode: str, residual_E: Tensor | None) -> tuple[TopK, RoutingPlan, Tensor, Tensor]:
    """Token rounding's top-K picks, rounded plan, f_e and c_e (sonic/routing/token_rounding.py, which defines it)."""
    from sonic.routing import token_rounding  # noqa: PLC0415 (that module imports this one)

    return token_rounding.route_token_rounding(sys.modules[__name__], logits_TE, bias_E, k, order, renormalize, tile,
                                               mode, residual_E)


def count_per_expert(expert_idx: Tensor, num_experts: int) -> Tensor:
    """How often each expert id occurs (int64, on device, no host sync). Integer scatter_add: exact in any
    order, so deterministic, and not index_put's sort-based accumulate."""
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_idx.device)
    flat = expert_idx.reshape(-1).long()
    return counts_E.scatter_add_(0, flat, torch.ones_like(flat))


def topk_method(router, logits_TE: Tensor, backend) -> tuple[TopK, RoutingPlan, Tensor]:
    """routing.method=topk: the top-K picks and their plan (one call: the fused backend builds both in one
    op), whose counts are the plan's."""
    topk, plan = backend.route_topk(logits_TE, router.selection_bias(logits_TE), router.top_k, router.cfg.order,
                                    router.cfg.renormalize)
    return topk, plan, plan.counts_E()


def select(router, logits_TE: Tensor, backend) -> TopK:
    """The router's top-K selection (expert bias, gate order) on `backend`, for the methods beyond top-K."""
    return backend.select_topk(logits_TE, router.selection_bias(logits_TE), router.top_k, router.cfg.order,
                               router.cfg.renormalize)
