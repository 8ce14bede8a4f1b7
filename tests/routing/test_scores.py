"""Router scores (routing.input_centring): prefix centring hides a per-sequence shared vector from the
router, reads no later position or other sequence, and matches its definition."""
from __future__ import annotations

import pytest
import torch

from sonic.models.config import MoEConfig
from sonic.models.moe import MoE
from sonic.routing import Router, RoutingConfig

B, S, D, E, K = 3, 12, 16, 8, 2


def prefix_router(**cfg) -> Router:
    torch.manual_seed(0)
    return Router(D, E, K, RoutingConfig(input_centring="prefix", **cfg))


def definition(x_BSD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """c_t = x_t - mean(x_s, s < t) (c_0 = x_0); logits = W c / rms(c), one position at a time."""
    out = []
    for seq in x_BSD.double():
        for t in range(seq.shape[0]):
            c = seq[t] - seq[:t].mean(0) if t else seq[t]
            out.append(weight_ED.double() @ c / c.square().mean().add(1e-6).sqrt())
    return torch.stack(out)


def test_prefix_scores_match_the_definition():
    router = prefix_router()
    x = torch.randn(B, S, D)
    got = router.scores(x.view(-1, D), router.weight_ED, S)
    torch.testing.assert_close(got.double(), definition(x, router.weight_ED.detach()), rtol=1e-5, atol=1e-5)


def test_prefix_centring_hides_a_per_sequence_shared_vector():
    router = prefix_router()
    x = torch.randn(B, S, D)
    shared = 20 * torch.randn(B, 1, D)  # what attention writes at every position of a sequence, 20x the tokens
    plain = router.scores(x.view(-1, D), router.weight_ED, S).view(B, S, E)
    with_shared = router.scores((x + shared).view(-1, D), router.weight_ED, S).view(B, S, E)
    torch.testing.assert_close(with_shared[:, 1:], plain[:, 1:], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(with_shared[:, 0], plain[:, 0])  # position 0 has no earlier position to centre on
    raw = Router(D, E, K, RoutingConfig())  # for contrast: the raw router's top-K follows the shared vector
    with torch.no_grad():
        raw.weight_ED.copy_(router.weight_ED)
    picks = raw((x + shared).view(-1, D)).topk_counts_E
    assert picks.max() >= 0.9 * S * B  # nearly every token picks the same expert


def test_prefix_centring_reads_no_later_position_and_no_other_sequence():
    router = prefix_router()
    x = torch.randn(B, S, D)
    before = router.scores(x.view(-1, D), router.weight_ED, S).view(B, S, E)
    changed = x.clone()
    changed[1, 5] += 10.0
    after = router.scores(changed.view(-1, D), router.weight_ED, S).view(B, S, E)
    same = torch.ones(B, S, dtype=torch.bool)
    same[1, 5:] = False
    assert torch.equal(after[same], before[same])
    assert not torch.allclose(after[1, 5:], before[1, 5:])


def test_prefix_scores_gradcheck():
    router = prefix_router().double()
    x = torch.randn(2 * 5, D, dtype=torch.float64, requires_grad=True)
    w = router.weight_ED.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: router.scores(x, w, 5), (x, w))


def test_raw_scores_are_the_linear_layer():
    router = Router(D, E, K, RoutingConfig())
    x = torch.randn(B * S, D)
    assert torch.equal(router.scores(x, router.weight_ED, S), x @ router.weight_ED.T)


def test_prefix_router_under_bf16_autocast_matches_fp32():
    router = prefix_router()
    x = torch.randn(B * S, D)
    fp32 = router(x, S).plan
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = router(x.bfloat16(), S).plan
    # bf16 inputs move near-tied logits; most picks must agree, and the gates stay fp32
    agree = (fp32.expert_idx_R.view(-1, K).sort(-1).values == bf16.expert_idx_R.view(-1, K).sort(-1).values).all(-1)
    assert agree.float().mean() > 0.8
    assert bf16.scores_R.dtype == torch.float32


@pytest.mark.parametrize("centring", ["none", "prefix"])
def test_moe_block_centres_each_sequence_on_its_own(centring):
    """MoE passes the sequence length: a vector added to one whole sequence changes only that
    sequence's position 0 under prefix centring (everything under none)."""
    torch.manual_seed(0)
    moe = MoE(D, MoEConfig(num_experts=E, top_k=K, expert_dim=8,
                           routing=RoutingConfig(input_centring=centring), kernel_backend="reference"))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(B, S, D)
    shifted = x.clone()
    shifted[1] += 20 * torch.randn(D)
    logits = []
    moe.router.register_forward_hook(lambda m, a, out: logits.append(m.scores(a[0], m.weight_ED, a[1])))
    moe(x)
    moe(shifted)
    before, after = (t.view(B, S, E) for t in logits)
    if centring == "prefix":
        torch.testing.assert_close(after[1, 1:], before[1, 1:], rtol=1e-4, atol=1e-4)
    else:
        assert not torch.allclose(after[1, 1:], before[1, 1:])
    assert torch.equal(after[[0, 2]], before[[0, 2]])
