"""Router losses: Switch load balancing and z-loss.

Legend: T tokens, E experts, K top-k.
"""
from __future__ import annotations

import torch
from torch import Tensor


def switch_aux_loss(probs_TE: Tensor, picks_E: Tensor) -> Tensor:
    """E * sum_e f_e * P_e (Switch Transformer): 1 under uniform routing, E when all goes to one expert.

    f_e = the fraction of the top-K picks that went to e (no gradient; the caller may count them
    over the whole data-parallel batch), P_e = this batch's mean full-softmax probability of e
    (the gradient path). f comes from the token-choice top-K selection under every method, so
    token rounding does not change the loss.
    """
    E = probs_TE.shape[1]
    frac_E = picks_E.to(probs_TE.dtype) / picks_E.sum().clamp_min(1)
    return E * (frac_E * probs_TE.mean(0)).sum()


def z_loss(logits_TE: Tensor) -> Tensor:
    """mean_t logsumexp(logits_t)^2 (ST-MoE): keeps router logits small for numerical stability."""
    return torch.logsumexp(logits_TE, -1).square().mean()
