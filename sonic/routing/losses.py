"""Router losses: Switch load balancing and z-loss, from the statistics every routing backend's select_topk
returns (no second pass over T x E).

Legend: T tokens, E experts, K top-k.
"""
from __future__ import annotations

import torch
from torch import Tensor


def switch_aux_loss(probs_mean_E: Tensor, picks_E: Tensor) -> Tensor:
    """E * sum_e f_e * P_e (Switch Transformer): 1 under uniform routing, E when all goes to one expert.

    f_e = the fraction of the top-K picks that went to e (no gradient; the caller may count them
    over the whole data-parallel batch), P_e = this batch's mean full-softmax probability of e
    (the gradient path). f comes from the token-choice top-K selection under every method, so
    token rounding does not change the loss. Leading dims are independent groups (one loss each).
    """
    E = probs_mean_E.shape[-1]
    frac_E = picks_E.to(probs_mean_E.dtype) / picks_E.sum(-1, keepdim=True).clamp_min(1)
    return E * (frac_E * probs_mean_E).sum(-1)


def sequence_aux_loss(logits_TE: Tensor, lse_T: Tensor, expert_idx_TK: Tensor, seq_len: int) -> Tensor:
    """switch_aux_loss within each sequence, averaged over the sequences (DeepSeek-V3's sequence-wise balance
    loss): a sequence that sends its tokens to its own few experts pays for it even when the batch's loads
    even out. P_e is recomputed from the logits and lse_T (one pass over T x E), f_e from the picks.
    """
    T, E = logits_TE.shape
    assert seq_len > 0 and T % seq_len == 0, (T, seq_len)
    B = T // seq_len
    probs_mean_BE = torch.exp(logits_TE.to(lse_T.dtype) - lse_T[:, None]).view(B, seq_len, E).mean(1)
    return switch_aux_loss(probs_mean_BE, picks_per_sequence(expert_idx_TK, seq_len, E, probs_mean_BE.dtype)).mean()


def picks_per_sequence(expert_idx_TK: Tensor, seq_len: int, num_experts: int, dtype: torch.dtype) -> Tensor:
    """(B, E): how many of each sequence's top-K picks went to each expert (T = B * seq_len, rows in sequence
    order)."""
    picks_BK = expert_idx_TK.reshape(expert_idx_TK.shape[0] // seq_len, -1).long()
    return torch.zeros(picks_BK.shape[0], num_experts, dtype=dtype, device=expert_idx_TK.device).scatter_add_(
        1, picks_BK, torch.ones_like(picks_BK, dtype=dtype))


def z_loss(lse_T: Tensor) -> Tensor:
    """mean_t logsumexp(logits_t)^2 (ST-MoE): keeps router logits small for numerical stability."""
    return lse_T.square().mean() if lse_T.numel() else lse_T.sum()
