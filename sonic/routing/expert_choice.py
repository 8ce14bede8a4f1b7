"""Expert choice (Zhou et al. 2022): each expert takes its top-`capacity` tokens by score.

Legend: T tokens, E experts, K top-k, C capacity.

Every expert gets exactly C rows, so load is balanced by construction; a token may get
any number of experts, zero included. The selection looks at the whole batch (future
tokens too), so it is a training-time method for non-causal batches or a baseline.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from sonic.routing.plan import RoutingPlan, TopK, build_plan
from sonic.routing.token_choice import count_per_expert, select


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * T * K / E), capped at T.

    Rounded to 6 decimals before the ceiling so that float noise (1.1 * 100 = 110.00000000000001)
    does not add a row.
    """
    return min(num_tokens, math.ceil(round(capacity_factor * num_tokens * top_k / num_experts, 6)))


def expert_choice_plan(probs_TE: Tensor, select_TE: Tensor, capacity: int) -> RoutingPlan:
    """Expert e takes the `capacity` tokens with the highest select_TE[:, e]; gates are probs_TE."""
    T, E = probs_TE.shape
    assert 0 <= capacity <= T, (capacity, T)
    token_idx_CE = select_TE.detach().topk(capacity, dim=0).indices
    expert_idx_CE = torch.arange(E, device=probs_TE.device).expand(capacity, E)
    gates_CE = probs_TE.gather(0, token_idx_CE)
    return build_plan(token_idx_CE.reshape(-1), expert_idx_CE.reshape(-1), gates_CE.reshape(-1), T, E)


def expert_choice_method(router, logits_TE: Tensor, backend) -> tuple[TopK, RoutingPlan, Tensor]:
    """routing.method=expert_choice: C = capacity rows per expert, chosen by the biased softmax, gated by
    the unbiased one; the aux loss still counts the token-choice picks."""
    topk = select(router, logits_TE, backend)  # for the aux loss's picks and its statistics
    logits_TE = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
    T, E, K = logits_TE.shape[0], router.num_experts, router.top_k
    capacity = expert_capacity(T, E, K, router.cfg.capacity_factor)
    select_TE = logits_TE.detach() + router.expert_bias_E.to(logits_TE.dtype)
    plan = expert_choice_plan(logits_TE.softmax(-1), select_TE.softmax(-1), capacity)
    return topk, plan, count_per_expert(topk.expert_idx_TK, E)
