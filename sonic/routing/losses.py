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
    token rounding does not change the loss.
    """
    E = probs_mean_E.shape[0]
    frac_E = picks_E.to(probs_mean_E.dtype) / picks_E.sum().clamp_min(1)
    return E * (frac_E * probs_mean_E).sum()


def z_loss(lse_T: Tensor) -> Tensor:
    """mean_t logsumexp(logits_t)^2 (ST-MoE): keeps router logits small for numerical stability."""
    return lse_T.square().mean() if lse_T.numel() else lse_T.sum()
