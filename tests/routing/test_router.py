"""Router: top-K orders, losses, aux-loss-free expert bias, expert choice, checkpointed recompute."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from sonic.kernels import reference
from sonic.routing import Router, RoutingConfig, expert_capacity
from sonic.routing.losses import picks_per_sequence


def router_with_logits(logits_TE, K, **cfg):
    """A router with an identity weight (D = E) and its input x = logits_TE, so its logits are x."""
    T, E = logits_TE.shape
    router = Router(E, E, K, RoutingConfig(**cfg))
    with torch.no_grad():
        router.weight_ED.copy_(torch.eye(E))
    return router, logits_TE.clone().requires_grad_()


def rows(plan):
    """{(token, expert): gate} of a plan."""
    return {(t, e): s for t, e, s in zip(plan.token_idx_R.tolist(), plan.expert_idx_R.tolist(),
                                         plan.scores_R.tolist())}


LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0],
                       [0.0, 3.0, 0.0, 1.0],
                       [1.0, 1.5, 2.5, 0.5]])


def test_topk_softmax_gates():
    router, x = router_with_logits(LOGITS, 2)
    got = rows(router(x).plan)
    want = {}
    for t, row in enumerate(LOGITS.tolist()):
        top = sorted(range(4), key=lambda e: -row[e])[:2]
        z = sum(math.exp(row[e]) for e in top)
        want.update({(t, e): math.exp(row[e]) / z for e in top})
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(want[k], rel=1e-6) for k in want)


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_gates(renormalize):
    router, x = router_with_logits(LOGITS, 2, order="softmax_topk", renormalize=renormalize)
    got = rows(router(x).plan)
    for t, row in enumerate(LOGITS.tolist()):
        z_all = sum(math.exp(v) for v in row)
        top = sorted(range(4), key=lambda e: -row[e])[:2]
        p = {e: math.exp(row[e]) / z_all for e in top}
        norm = sum(p.values()) if renormalize else 1.0
        for e in top:
            assert got[(t, e)] == pytest.approx(p[e] / norm, rel=1e-6)
    assert len(got) == 6


def test_router_math_is_fp32_under_bf16_and_autocast():
    router = Router(16, 8, 2, RoutingConfig())
    x = torch.randn(10, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x)
    assert out.plan.scores_R.dtype == torch.float32 and out.loss.dtype == torch.float32
    assert router.double()(x.double()).plan.scores_R.dtype == torch.float64  # fp64 stays fp64 (grad checks)


def test_losses_by_hand():
    """T=2, E=2, K=1, logits (ln 3, 0) per token: P = (3/4, 1/4), both tokens pick expert 0.

    aux = E * sum_e f_e * mean P_e = 2 * (1 * 3/4 + 0 * 1/4) = 1.5; z = logsumexp^2 = (ln 4)^2.
    """
    logits = torch.tensor([[math.log(3.0), 0.0], [math.log(3.0), 0.0]])
    router, x = router_with_logits(logits, 1, aux_loss_coef=0.1, z_loss_coef=0.01)
    out = router(x)
    assert out.aux_loss.item() == pytest.approx(1.5, rel=1e-6)
    assert out.z_loss.item() == pytest.approx(math.log(4.0) ** 2, rel=1e-6)
    assert out.loss.item() == pytest.approx(0.1 * 1.5 + 0.01 * math.log(4.0) ** 2, rel=1e-6)
    assert not out.aux_loss.requires_grad and out.loss.requires_grad
    # d aux / d logits flows through mean P only: d/dl_t0 of 2 * mean_t P_t0 = P_t0 * P_t1 = 3/16 per token
    (g,) = torch.autograd.grad(out.loss, x)
    dz = 2 * math.log(4.0) * torch.tensor([0.75, 0.25]) / 2  # d mean(lse^2)/d l = 2 lse * P / T
    want = 0.1 * torch.tensor([3 / 16, -3 / 16]) + 0.01 * dz
    torch.testing.assert_close(g, want.expand(2, 2), rtol=1e-5, atol=1e-7)


def test_aux_loss_uniform_and_collapsed():
    E, K, T = 8, 2, 64
    uniform = torch.zeros(T, E)
    uniform[torch.arange(T), torch.arange(T) % E] = 1.0  # counts exactly balanced, P nearly uniform
    router, x = router_with_logits(uniform * 1e-3, K)
    assert router(x).aux_loss.item() == pytest.approx(1.0, rel=1e-3)
    collapsed = torch.zeros(T, E)
    collapsed[:, :K] = 50.0  # all mass and all picks on experts 0..K-1
    router, x = router_with_logits(collapsed, K)
    assert router(x).aux_loss.item() == pytest.approx(E / K, rel=1e-4)


def test_sequence_aux_loss_sees_what_the_batch_loss_averages_away():
    """Two sequences of 4 tokens, E=2, K=1: the first sends every token to expert 0, the second to expert 1.
    The batch's loads are even (aux = 1), each sequence's are not: in sequence 0, f = (1, 0) and mean P = (p, 1-p)
    with p = 3/4, so E * sum f P = 1.5; the same in sequence 1, and their mean is 1.5."""
    seq0 = torch.tensor([[math.log(3.0), 0.0]]).expand(4, 2)
    logits = torch.cat([seq0, seq0.flip(-1)])
    router, x = router_with_logits(logits, 1, aux_loss_coef=0.0, seq_aux_loss_coef=0.1)
    out = router(x, seq_len=4)
    assert out.aux_loss.item() == pytest.approx(1.0, rel=1e-6)
    assert out.seq_aux_loss.item() == pytest.approx(1.5, rel=1e-6)
    assert out.loss.item() == pytest.approx(0.1 * 1.5, rel=1e-6) and not out.seq_aux_loss.requires_grad
    # d/dl_t0 of mean_b E * mean_t P_t0 (f = (1, 0)) = 2 * P0 P1 / 4 / 2 = 3/64 for sequence 0's tokens; mirrored
    (g,) = torch.autograd.grad(out.loss, x)
    want = 0.1 * torch.tensor([3 / 64, -3 / 64])
    torch.testing.assert_close(g, torch.cat([want.expand(4, 2), want.flip(-1).expand(4, 2)]), rtol=1e-5, atol=1e-7)
    # one sequence of all 8 tokens: the batch's loss again; off by default: no loss, logged as 0
    assert router(x).seq_aux_loss.item() == pytest.approx(1.0, rel=1e-6)
    plain, x = router_with_logits(logits, 1)
    out = plain(x, seq_len=4)
    assert out.seq_aux_loss.item() == 0 and out.loss.item() == pytest.approx(0.01 * 1.0, rel=1e-6)


def test_picks_per_sequence_counts_each_sequence_apart():
    """Rows are in sequence order: sequence b owns rows b*S .. (b+1)*S - 1, each row's K picks count once."""
    expert_idx_TK = torch.tensor([[0, 1], [0, 2], [3, 1], [3, 3]])
    got = picks_per_sequence(expert_idx_TK, 2, 4, torch.float32)
    assert torch.equal(got, torch.tensor([[2.0, 1, 1, 0], [0, 1, 0, 3]]))


def test_aux_loss_uses_topk_counts_under_token_rounding():
    torch.manual_seed(0)
    x = torch.randn(100, 16)
    topk = Router(16, 8, 2, RoutingConfig(aux_loss_coef=1.0))
    tr = Router(16, 8, 2, RoutingConfig(method="token_rounding", rounding_mode="up", tile_size=32, aux_loss_coef=1.0))
    tr.load_state_dict(topk.state_dict())
    a, b = topk(x), tr.train()(x)
    assert not torch.equal(a.counts_E, b.counts_E)
    assert torch.equal(a.topk_counts_E, b.topk_counts_E) and torch.equal(a.aux_loss, b.aux_loss)


def test_expert_bias_update_direction():
    router = Router(4, 4, 1, RoutingConfig(bias_update_rate=0.01))
    router.update_expert_bias(torch.tensor([10, 0, 5, 5]))
    torch.testing.assert_close(router.expert_bias_E, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    router.update_expert_bias(torch.tensor([10, 0, 5, 5]))
    torch.testing.assert_close(router.expert_bias_E, torch.tensor([-0.02, 0.02, 0.0, 0.0]))
    off = Router(4, 4, 1, RoutingConfig())
    off.update_expert_bias(torch.tensor([10, 0, 5, 5]))
    assert (off.expert_bias_E == 0).all()  # rate 0 disables it
    with pytest.raises(ValueError, match="update_expert_bias"):
        router.update_expert_bias(torch.tensor([1, 2, 3]))
    assert "expert_bias_E" in router.state_dict()  # persistent: checkpoints resume it


def test_proportional_bias_update_moves_by_the_relative_gap():
    from sonic.routing.config import BIAS_RULES
    from sonic.routing.router import BIAS_STEPS

    assert set(BIAS_STEPS) == set(BIAS_RULES)
    router = Router(4, 4, 1, RoutingConfig(bias_update_rate=0.1, bias_update_rule="proportional"))
    router.update_expert_bias(torch.tensor([20, 0, 5, 15]))  # mean 10: gaps -1, +1, +0.5, -0.5
    torch.testing.assert_close(router.expert_bias_E, torch.tensor([-0.1, 0.1, 0.05, -0.05]))
    router.update_expert_bias(torch.tensor([0, 0, 0, 0]))  # nothing routed: no step
    torch.testing.assert_close(router.expert_bias_E, torch.tensor([-0.1, 0.1, 0.05, -0.05]))
    with pytest.raises(ValueError, match="routing.bias_update_rule='linear' is not one of sign, proportional"):
        RoutingConfig(bias_update_rule="linear")


@pytest.mark.parametrize("order", ["topk_softmax", "softmax_topk"])
def test_expert_bias_changes_selection_not_gates(order):
    router, x = router_with_logits(LOGITS, 2, order=order, bias_update_rate=0.5)
    before = rows(router(x).plan)
    router.expert_bias_E.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))  # expert 3 now wins everywhere
    out = router(x)
    after = rows(out.plan)
    assert all((t, 3) in after for t in range(3)) and not all((t, 3) in before for t in range(3))
    for t, row in enumerate(LOGITS.tolist()):  # gates from the unbiased logits of the picked experts
        picked = [e for (t_, e) in after if t_ == t]
        if order == "topk_softmax":
            z = sum(math.exp(row[e]) for e in picked)
            want = {e: math.exp(row[e]) / z for e in picked}
        else:
            z = sum(math.exp(v) for v in row)
            want = {e: math.exp(row[e]) / z for e in picked}
        for e in picked:
            assert after[(t, e)] == pytest.approx(want[e], rel=1e-6)
    assert out.aux_loss.item() == pytest.approx(  # f from the biased selection, P unbiased
        4 * sum(out.topk_counts_E[e].item() / 6 * LOGITS.softmax(-1)[:, e].mean().item() for e in range(4)), rel=1e-6)


def test_expert_bias_balances_load_over_steps():
    """Repeated updates move a skewed router towards equal counts."""
    torch.manual_seed(0)
    router = Router(16, 8, 2, RoutingConfig(bias_update_rate=0.05))
    with torch.no_grad():
        router.weight_ED[0] += 2.0  # a strong pull towards expert 0 for x with positive mean
    x = torch.randn(512, 16) + 0.3
    first = router(x).counts_E.float()
    for _ in range(200):
        router.update_expert_bias(router(x).counts_E)
    last = router(x).counts_E.float()
    assert last.std() < 0.5 * first.std()


def test_counts_are_device_tensors_of_routed_rows():
    out = Router(16, 8, 2, RoutingConfig())(torch.randn(30, 16))
    assert isinstance(out.counts_E, torch.Tensor) and out.counts_E.sum().item() == 60
    assert torch.equal(out.counts_E, out.plan.counts_E())


# ---------------------------------------------------------------- expert choice


@pytest.mark.parametrize("T,E,K,cf,want", [(100, 8, 2, 1.0, 25), (100, 8, 2, 1.25, 32), (1000, 10, 1, 1.1, 110),
                                           (10, 4, 2, 8.0, 10), (3, 64, 1, 1.0, 1)])
def test_expert_capacity(T, E, K, cf, want):
    assert expert_capacity(T, E, K, cf) == want


def test_expert_choice_takes_top_capacity_tokens_per_expert():
    torch.manual_seed(0)
    T, D, E, K = 100, 16, 8, 2
    router = Router(D, E, K, RoutingConfig(method="expert_choice", capacity_factor=1.25))
    x = torch.randn(T, D)
    out = router(x)
    C = math.ceil(1.25 * T * K / E)
    assert out.counts_E.tolist() == [C] * E
    probs = (x @ router.weight_ED.detach().T).softmax(-1)
    got = rows(out.plan)
    for e in range(E):
        chosen = {t for (t, e_) in got if e_ == e}
        assert chosen == set(probs[:, e].topk(C).indices.tolist())
        for t in chosen:
            assert got[(t, e)] == pytest.approx(probs[t, e].item(), rel=1e-6)
    assert router.eval()(x).counts_E.tolist() == [C] * E  # a method, not a training trick


def test_expert_choice_capacity_capped_at_t():
    router = Router(8, 4, 2, RoutingConfig(method="expert_choice", capacity_factor=100.0))
    out = router(torch.randn(6, 8))
    assert out.counts_E.tolist() == [6] * 4


# ---------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("mode", ["balance", "stochastic", "nearest_score"])
def test_token_rounding_survives_checkpoint_recompute(mode):
    """Recomputing the router inside backward must repeat the forward's rows, and balance
    must advance its residual once per micro-batch, not once per recompute."""
    T, D, N, E, K, M = 96, 16, 8, 8, 2, 8
    torch.manual_seed(0)
    cfg = RoutingConfig(method="token_rounding", rounding_mode=mode, tile_size=M)
    routers = [Router(D, E, K, cfg).train() for _ in range(2)]
    routers[1].load_state_dict(routers[0].state_dict())
    w1 = torch.randn(E, 2 * N, D, requires_grad=True)
    w2 = torch.randn(E, D, N, requires_grad=True)

    def layer(router, x):
        return reference.experts(x, w1, w2, router(x).plan)

    for step in range(3):
        x = torch.randn(T, D, requires_grad=True)
        state = torch.get_rng_state()
        plain = layer(routers[0], x)
        g_plain = torch.autograd.grad(plain.square().sum(), [x, w1, routers[0].weight_ED])
        torch.set_rng_state(state)
        ckpt = checkpoint(layer, routers[1], x, use_reentrant=False)
        g_ckpt = torch.autograd.grad(ckpt.square().sum(), [x, w1, routers[1].weight_ED])
        torch.testing.assert_close(ckpt, plain)
        for a, b in zip(g_ckpt, g_plain):
            torch.testing.assert_close(a, b)
        for name in ("balance_residual_E", "balance_pending_E"):
            assert torch.equal(getattr(routers[0], name), getattr(routers[1], name)), (step, name)
    if mode == "balance":
        assert routers[0].balance_pending_E.abs().sum() > 0


def test_moe_block_under_autocast_saves_no_fp32_copy_of_x():
    """The router GEMM reads the same bf16 X as the experts: nothing of shape (T, D) is saved in fp32,
    and the bf16 X is saved once (one storage), whatever the router, experts and shared expert keep."""
    from sonic.models.config import MoEConfig
    from sonic.models.moe import MoE

    T, D = 64, 32
    block = MoE(D, MoEConfig(num_experts=4, top_k=2, expert_dim=16, shared_expert_dim=24, kernel_backend="reference"))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, T // 2, D, requires_grad=True)  # an fp32 residual stream, as in single-GPU runs
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, routed = block(x)
    x_like = [t for t in saved if t.shape == (T, D)]
    assert x_like and all(t.dtype == torch.bfloat16 for t in x_like)
    assert len({t.untyped_storage().data_ptr() for t in x_like}) == 1
    assert routed.plan.scores_R.dtype == torch.float32
    (out.float().square().mean() + routed.loss).backward()
    assert block.router.weight_ED.grad is not None and block.router.weight_ED.grad.abs().sum() > 0
