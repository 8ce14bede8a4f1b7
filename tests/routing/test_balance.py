"""routing.balance=sinkhorn: a per-expert offset solved on the batch spreads the picks of a batch whose tokens
share part of their logits (the deep routers' collapse at peak learning rate, docs/routing.md section 3), and
changes the selection only: the gates, the losses' statistics and the expert bias are untouched."""
from __future__ import annotations

import pytest
import torch

from sonic.routing import Router, RoutingConfig
from sonic.routing.balance import sinkhorn_offset

T, E, K = 4096, 64, 4


def collapsed_logits(seed: int = 0, common: float = 3.0) -> torch.Tensor:
    """Logits whose experts differ by a shared part (every token prefers the same few experts) plus a skewed
    token part: most tokens lean one way, a few far the other, so removing each expert's mean leaves them
    leaning alike."""
    g = torch.Generator().manual_seed(seed)
    shared_E = common * torch.randn(E, generator=g)
    skew_E = 1.5 * torch.randn(E, generator=g)
    lean_T = torch.rand(T, 1, generator=g) ** 3
    return shared_E + 0.2 * torch.randn(T, E, generator=g) + lean_T * skew_E


def max_over_mean(counts_E: torch.Tensor) -> float:
    return (counts_E.max() / counts_E.float().mean()).item()


def identity_router(**cfg) -> Router:
    router = Router(E, E, K, RoutingConfig(**cfg))
    with torch.no_grad():
        router.weight_ED.copy_(torch.eye(E))
    return router


@pytest.mark.parametrize("common", [3.0, 30.0])
def test_sinkhorn_spreads_a_collapsed_batch(common):
    x_TE = collapsed_logits(common=common)
    plain = identity_router()(x_TE)
    balanced = identity_router(balance="sinkhorn")(x_TE)
    assert max_over_mean(plain.counts_E) > 8  # E/K = 16 is every token on the same K experts
    assert max_over_mean(balanced.counts_E) < 1.4
    assert balanced.counts_E.sum() == T * K


def test_more_iterations_balance_more_closely():
    x_TE = collapsed_logits()
    loads = [max_over_mean(identity_router(balance="sinkhorn", balance_iters=n)(x_TE).counts_E) for n in (1, 8)]
    assert loads[1] < loads[0], loads


def test_the_offset_changes_the_selection_only():
    """Gates are the softmax over the picked experts' unbiased logits; the loss statistics read the logits."""
    x_TE = collapsed_logits()
    plain = identity_router()
    router = identity_router(balance="sinkhorn")
    out = router(x_TE)
    plan = out.plan
    logits_TE = x_TE.float()
    by_token = {}
    for t, e, s in zip(plan.token_idx_R.tolist(), plan.expert_idx_R.tolist(), plan.scores_R.tolist()):
        by_token.setdefault(t, {})[e] = s
    for t in (0, 17, T - 1):
        picks = sorted(by_token[t])
        want = logits_TE[t, picks].softmax(-1)
        got = torch.tensor([by_token[t][e] for e in picks])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.z_loss, plain(x_TE).z_loss)
    assert torch.equal(router.expert_bias_E, torch.zeros(E))  # the offset is not state


def test_offset_is_centred_shift_invariant_and_keeps_the_bias():
    x_TE = collapsed_logits()
    bias_E = torch.linspace(-0.5, 0.5, E)
    offset_E = sinkhorn_offset(x_TE, bias_E, 4, 0.3) - bias_E
    assert abs(offset_E.mean().item()) < 1e-5
    # adding a constant to every logit of one token, or to all logits, moves no pick
    shifted_TE = x_TE + torch.randn(T, 1) + 5.0
    picks = (x_TE + bias_E + offset_E).topk(K, -1).indices
    shifted_picks = (shifted_TE + sinkhorn_offset(shifted_TE, bias_E, 4, 0.3)).topk(K, -1).indices
    assert (picks.sort(-1).values == shifted_picks.sort(-1).values).float().mean() > 0.999
    empty = torch.empty(0, E)
    assert torch.equal(sinkhorn_offset(empty, bias_E, 4, 0.3), bias_E)


def test_token_rounding_rounds_the_balanced_picks():
    x_TE = collapsed_logits()
    out = identity_router(method="token_rounding", tile_size=16, balance="sinkhorn").train()(x_TE)
    assert max_over_mean(out.topk_counts_E) < 1.4
    assert (out.counts_E % 16 == 0).all()
