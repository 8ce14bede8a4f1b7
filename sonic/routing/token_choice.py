"""Token choice: each token picks its top-K experts; the gates depend on the `order`.

Legend: T tokens, E experts, K top-k.

  topk_softmax   gates = softmax over the K picked logits (the SonicMoE default)
  softmax_topk   gates = full softmax over E at the K picks, optionally renormalised to sum 1

Selection and gates are separate on purpose: the selection logits may carry the
aux-loss-free expert bias, the gates never do (DeepSeek-V3).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class TopK(NamedTuple):
    expert_idx_TK: Tensor  # int64, the K distinct experts of each token
    gates_TK: Tensor  # differentiable gate of each pick


def select_topk(logits_TE: Tensor, select_TE: Tensor, probs_TE: Tensor, top_k: int, order: str,
                renormalize: bool) -> TopK:
    """Top-K over `select_TE` (the logits plus any selection bias), gates from the unbiased logits."""
    expert_idx_TK = select_TE.detach().topk(top_k, dim=-1).indices
    if order == "topk_softmax":
        gates_TK = logits_TE.gather(1, expert_idx_TK).softmax(-1)
    else:
        assert order == "softmax_topk", order
        gates_TK = probs_TE.gather(1, expert_idx_TK)
        if renormalize:
            gates_TK = gates_TK / gates_TK.sum(-1, keepdim=True)
    return TopK(expert_idx_TK, gates_TK)


def count_per_expert(expert_idx: Tensor, num_experts: int) -> Tensor:
    """How often each expert id occurs (int64, on device, no host sync, deterministic)."""
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_idx.device)
    ones = torch.ones(expert_idx.numel(), dtype=torch.int64, device=expert_idx.device)
    return counts_E.index_put_((expert_idx.reshape(-1),), ones, accumulate=True)
