"""Selection balance (routing.balance): a per-expert offset, solved on the current batch's logits, that the
top-K selection adds to them (beside the expert bias); the gates never see it.

Legend: T tokens, E experts.

none      no offset: each token takes its top-K of logits + expert bias.
sinkhorn  the offset g_E of `routing.balance_iters` Sinkhorn steps on exp((logits + bias) / tau): the scaling
          under which every token's row sums to 1 and every expert's column to T/E, so each expert is as likely
          a pick as any other over this batch. Each token then takes its top-K of logits + bias + g_E. tau is
          `routing.balance_temperature` times the spread of the tokens' own parts of the logits.

Why (docs/routing.md, section 3): at the recipe's peak learning rate the deep routers' tokens share part of
their logits, and that part moves from step to step, so the expert bias, which follows the load of past steps
at 0.01 a step, and the aux loss both trail it: whole layers send most tokens to the same experts. An offset
solved on this batch removes whatever the batch's tokens share, however fast it moves, before any token picks.
Measured on sonic_7b (docs/routing.md, section 3) it spreads the load but costs loss, so no preset turns it on.

It is computed without gradient in fp32 (the selection is not differentiable anyway), per process over its own
tokens. A token's picks then depend on the other tokens of its batch, as under token rounding or expert choice;
through E numbers per layer, so the future of its own sequence says next to nothing to it. Evaluation routes
the same way, over its own batch. The soft assignment lets a token put more than one pick's mass on one
expert, which hard top-K cannot: the picks balance less closely than the soft columns.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

BALANCES = ("none", "sinkhorn")


def no_offset(logits_TE: Tensor, bias_E: Tensor, iters: int, temperature: float) -> Tensor:
    """routing.balance=none: the selection's bias is the expert bias."""
    return bias_E


@torch.no_grad()
def sinkhorn_offset(logits_TE: Tensor, bias_E: Tensor, iters: int, temperature: float) -> Tensor:
    """routing.balance=sinkhorn: bias_E plus the column potential g_E of `iters` log-domain Sinkhorn steps on
    (logits + bias) / tau (rows to 1, columns to T/E), centred to mean 0. A row's potential shifts all of its
    logits alike, so only g_E changes which experts a token picks.

    tau is `temperature` times the spread of the tokens' own parts of the logits (their std once each token's
    mean over the experts and each expert's mean over the batch are removed). At tau much above that spread the
    soft columns balance as soon as each expert's mean logit is removed, while the picks, which read the order
    within each row, stay skewed (most tokens lean one way: docs/routing.md, section 3); near it the soft
    assignment approaches the hard one."""
    select_TE = logits_TE.detach().float() + bias_E.float()
    T, E = select_TE.shape
    if T == 0:
        return bias_E
    col_E = select_TE.mean(0)
    # a shift of one token's logits picks alike, and each expert's mean is what the potentials remove
    token_part_TE = select_TE - select_TE.mean(1, keepdim=True) - (col_E - col_E.mean())
    tau = temperature * token_part_TE.std().clamp_min(1e-6)
    z_TE = select_TE / tau
    log_col = math.log(T / E)
    g_E = -col_E / tau  # a warm start: removing each expert's mean logit is most of the way there
    f_T = -(z_TE + g_E).logsumexp(1)
    for _ in range(iters):
        g_E = log_col - (z_TE + f_T[:, None]).logsumexp(0)
        f_T = -(z_TE + g_E).logsumexp(1)
    return bias_E + ((g_E - g_E.mean()) * tau).to(bias_E.dtype)


OFFSETS = {"none": no_offset, "sinkhorn": sinkhorn_offset}
assert set(OFFSETS) == set(BALANCES)
