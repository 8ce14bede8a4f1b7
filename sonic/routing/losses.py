"""Router losses: Switch load balancing and z-loss.

Legend: T tokens, E experts, K top-k.
"""
from __future__ import annotations

import torch
from torch import Tensor


def switch_aux_loss(probs_TE: Tensor, topk_counts_E: Tensor, top_k: int) -> Tensor:
    """E * sum_e f_e * P_e (Switch Transformer): 1 under uniform routing, E when all goes to one expert.

    f_e = the fraction of the T*K top-K picks that went to e (no gradient), P_e = the mean
    full-softmax probability of e (the gradient path). f comes from the token-choice top-K
    selection under every method, so token rounding does not change the loss.
    """
    T, E = probs_TE.shape
    frac_E = topk_counts_E.to(probs_TE.dtype) / max(T * top_k, 1)
    return E * (frac_E * probs_TE.mean(0)).sum()


def z_loss(logits_TE: Tensor) -> Tensor:
    """mean_t logsumexp(logits_t)^2 (ST-MoE): keeps router logits small for numerical stability."""
    return torch.logsumexp(logits_TE, -1).square().mean()
