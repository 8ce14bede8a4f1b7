"""Router scores (routing.input_centring): prefix centring hides a per-sequence shared vector from the
router, reads no later position or other sequence, and matches its definition. routing.logit_norm=prefix:
each expert's logits standardised over the earlier positions, likewise causal, to its definition."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sonic.models.config import MoEConfig
from sonic.models.moe import MoE
from sonic.routing import Router, RoutingConfig, scores
from sonic.routing.scores import PRIOR_POSITIONS, standardise_by_prefix
from tests.helpers import saved_for_backward

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


def _autograd_definition(x_TD: torch.Tensor, weight_ED: torch.Tensor, seq_len: int, const_scale: bool):
    """prefix_centred_logits through plain autograd, its rstd a constant or not."""
    c_TD, mean_square_T = scores.prefix_centre(x_TD, seq_len)
    rstd_T = torch.rsqrt(mean_square_T + scores.EPS)
    return F.linear(c_TD, weight_ED) * (rstd_T.detach() if const_scale else rstd_T).unsqueeze(-1)


def test_prefix_scores_gradients_hold_the_scale_constant():
    """The router's weights get the whole gradient; x gets all of it but the rms's part (scores.py says why)."""
    router = prefix_router().double()
    S = 5
    x = torch.randn(2 * S, D, dtype=torch.float64, requires_grad=True)
    w = router.weight_ED.detach().clone().requires_grad_()
    dlogits = torch.randn(2 * S, E, dtype=torch.float64)

    def grads(logits):
        return torch.autograd.grad((logits * dlogits).sum(), (x, w))

    dx, dw = grads(router.scores(x, w, S))
    dx_const, dw_const = grads(_autograd_definition(x, w, S, const_scale=True))
    dx_full, dw_full = grads(_autograd_definition(x, w, S, const_scale=False))
    torch.testing.assert_close(dx, dx_const, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dw, dw_const, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dw, dw_full, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(dx, dx_full, rtol=1e-3, atol=1e-3)


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


def standardised_definition(z_BSE: torch.Tensor) -> torch.Tensor:
    """Each expert's logit at t minus the mean of the earlier ones over their spread, with PRIOR_POSITIONS of the
    prior (mean 0, mean square 1) mixed in; one position at a time, in fp64."""
    P, out = PRIOR_POSITIONS, []
    for seq in z_BSE.double():
        for t in range(seq.shape[0]):
            earlier = seq[:t]
            mean = earlier.sum(0) / (t + P)
            var = (earlier.square().sum(0) + P) / (t + P) - mean.square()
            out.append((seq[t] - mean) / var.clamp_min(1e-4).sqrt())
    return torch.stack(out)


def test_logit_norm_matches_its_definition_and_reads_no_later_position():
    router = prefix_router(logit_norm="prefix")
    x = torch.randn(B, S, D)
    raw = router.scores(x.view(-1, D), router.weight_ED, S)
    got = router.logits(x.view(-1, D), S)
    torch.testing.assert_close(got.double(), standardised_definition(raw.view(B, S, E)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.view(B, S, E)[:, 0], raw.view(B, S, E)[:, 0])  # position 0: the prior's (0, 1)
    changed = x.clone()
    changed[1, 5] += 10.0
    after = router.logits(changed.view(-1, D), S).view(B, S, E)
    same = torch.ones(B, S, dtype=torch.bool)
    same[1, 5:] = False
    assert torch.equal(after[same], got.view(B, S, E)[same])
    assert not torch.allclose(after[1, 5:], got.view(B, S, E)[1, 5:])
    assert torch.equal(Router(D, E, K, RoutingConfig(input_centring="prefix")).logit_norm(raw, S), raw)  # none


def test_logit_norm_evens_out_an_expert_with_a_wider_spread():
    """An expert whose weight row leans into the input's widest direction wins top-K through its upper tail; each
    expert's logits at one mean and spread take that away (statistics over long sequences, so the prior fades)."""
    torch.manual_seed(0)
    Bw, Sw = 4, 512
    scale_D = torch.ones(D)
    scale_D[0] = 6.0  # the router's input spreads most along one direction
    x = torch.randn(Bw * Sw, D) * scale_D
    loads = {}
    for norm in ("none", "prefix"):
        router = Router(D, E, K, RoutingConfig(logit_norm=norm))
        with torch.no_grad():
            router.weight_ED.copy_(torch.randn(E, D) * D ** -0.5)
            router.weight_ED[:, 0] = 0.0
            router.weight_ED[3, 0] = 3.0  # expert 3 alone leans into it: its logits spread ~18x wider
        counts = router(x, Sw).topk_counts_E.float()
        loads[norm] = (counts.max() / counts.mean()).item()
    # expert 3 takes about every token of its upper half: ~2x its share of E/K = 4 when the widths differ
    assert loads["none"] > 1.8 and loads["prefix"] < 1.25, loads


def test_logit_norm_passes_gradients_through_its_scale_only():
    """The statistics are constants to autograd: the gradient on the raw logits is the output's over the spread."""
    z = torch.randn(2 * 7, E, dtype=torch.float64, requires_grad=True)
    out = standardise_by_prefix(z, 7)
    g = torch.randn_like(out)
    out.backward(g)
    zB = z.detach().view(2, 7, E)
    P = PRIOR_POSITIONS
    n = torch.arange(7, dtype=torch.float64)[None, :, None] + P
    mean = (zB.cumsum(1) - zB) / n
    var = ((zB.square().cumsum(1) - zB.square()) + P) / n - mean.square()
    torch.testing.assert_close(z.grad, (g.view(2, 7, E) / var.sqrt()).view(-1, E))


def test_logit_norm_op_recovers_the_scale_over_long_sequences():
    """The op's backward recovers rstd from the standardised logits and the sums kept every STAT_CHUNK positions,
    one position at a time: over sequences of many chunks, with a large shared offset and experts of different
    spreads, its fp32 gradient stays the definition's (computed in fp64) to fp32 rounding, as does its output."""
    gen = torch.Generator().manual_seed(0)
    Bl, Sl, El = 2, 40 * scores.STAT_CHUNK + 7, 6
    z = torch.randn(Bl, Sl, El, generator=gen) * torch.tensor([0.1, 1, 3, 10, 30, 100])
    z = (z + 50 * torch.randn(Bl, 1, El, generator=gen)).view(-1, El)
    dy = torch.randn(Bl * Sl, El, generator=gen)
    z64 = z.double().requires_grad_()
    y64 = standardise_by_prefix(z64, Sl)
    (dz64,) = torch.autograd.grad((y64 * dy.double()).sum(), z64)
    z32 = z.clone().requires_grad_()
    y32 = scores.PrefixStandardisedLogits()(z32, Sl)
    (y32 * dy).sum().backward()
    torch.testing.assert_close(y32.double(), y64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(z32.grad.double(), dz64, rtol=1e-5, atol=1e-5 * dz64.abs().max().item())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_logit_norm_keeps_only_its_output_for_backward(compiled):
    """Autograd through the norm's plain ops kept its scale, one T x E fp32 tensor beside the logits the
    selection keeps: every T x E tensor the op keeps is its output (the storage the selection keeps anyway), the
    rest is a few sums per STAT_CHUNK positions. Also under torch.compile with the min-cut partitioner."""
    Sl = 2 * scores.STAT_CHUNK
    z = torch.randn(B * Sl, E, requires_grad=True)
    y, saved = saved_for_backward(lambda z: scores.PrefixStandardisedLogits()(z * 2.0, Sl), z, compiled=compiled)
    assert saved, "nothing kept: the hook saw no saved tensor"
    assert sum(t.numel() for t in saved if t.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()) \
        <= 2 * B * E * 2, [tuple(t.shape) for t in saved]
    y.sum().backward()
    torch.testing.assert_close(z.grad, torch.autograd.grad(standardise_by_prefix(z * 2.0, Sl).sum(), z)[0])
    torch._dynamo.reset()
