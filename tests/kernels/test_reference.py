"""The reference SonicMoE autograd Function against plain autograd, and what it keeps for backward.

Gradients: the reference's hand-written backward must equal autograd through the naive
per-expert loop in float64, for routing plans from the real router (both top-K orders,
every token-rounding mode, expert choice) and hand-made edge cases.
Memory: the reference saves X, H and the plan only: 2Td + 4TKn bytes in bf16 plus the plan.
"""
from __future__ import annotations

import pytest
import torch

from bench.activation_memory import formula_bytes, random_problem, saved_tensor_bytes
from sonic.kernels import naive, reference
from sonic.routing import Router, RoutingConfig, plan_from_topk
from sonic.routing.plan import build_plan

F64 = dict(rtol=1e-10, atol=1e-12)


def make_experts(E, N, D, dtype=torch.float64, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape, scale: (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_()  # noqa: E731
    w1 = mk(E, 2 * N, D, scale=D ** -0.5)
    w2 = mk(E, D, N, scale=N ** -0.5)
    b1 = mk(E, 2 * N, scale=0.1) if bias else None
    b2 = mk(E, D, scale=0.1) if bias else None
    return w1, w2, b1, b2


def compare_grads(x, w1, w2, b1, b2, plan, extra=(), dtype_tol=F64, seed=1):
    """Forward both backends on one plan; compare outputs and grads w.r.t. every input."""
    inputs = [t for t in (x, w1, w2, b1, b2, *extra) if t is not None]
    out_ref = reference.experts(x, w1, w2, plan, b1, b2)
    out_naive = naive.experts(x, w1, w2, plan, b1, b2)
    torch.testing.assert_close(out_ref, out_naive, **dtype_tol)
    dout = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(seed), dtype=out_ref.dtype)
    g_ref = torch.autograd.grad(out_ref, inputs, dout, retain_graph=True, allow_unused=True)
    if out_naive.requires_grad:
        g_naive = torch.autograd.grad(out_naive, inputs, dout, retain_graph=True, allow_unused=True)
    else:  # no routed rows: the naive loop never touches its inputs
        assert plan.live_rows() == 0
        g_naive = [None] * len(inputs)
    for i, (a, b) in enumerate(zip(g_ref, g_naive)):
        b = torch.zeros_like(inputs[i]) if b is None else b  # unused input = zero gradient
        assert a is not None, i
        torch.testing.assert_close(a, b, **dtype_tol, msg=lambda m: f"grad of input {i}: {m}")
    return out_ref, g_ref


ROUTINGS = (
    [dict(method="topk", order="topk_softmax"), dict(method="topk", order="softmax_topk"),
     dict(method="topk", order="softmax_topk", renormalize=True),
     dict(method="expert_choice", capacity_factor=1.25)]
    + [dict(method="token_rounding", rounding_mode=m) for m in
       ("nearest", "stochastic", "nearest_score", "balance", "up", "down")]
    + [dict(method="token_rounding", rounding_mode="up", order="softmax_topk", renormalize=True)]
)


def routed(T, D, E, K, tile=8, skew=None, seed=0, **cfg):
    """A float64 router in training mode, its input and its output; `skew` biases selection."""
    torch.manual_seed(seed)
    router = Router(D, E, K, RoutingConfig(tile_size=tile, **cfg)).double().train()
    if skew is not None:
        router.expert_bias_E.copy_(skew)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    return router, x, router(x)


@pytest.mark.parametrize("cfg", ROUTINGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("bias", [False, True])
def test_grads_match_autograd_through_router(cfg, bias):
    T, D, N, E, K = 64, 12, 6, 8, 2
    router, x, out = routed(T, D, E, K, **cfg)
    w1, w2, b1, b2 = make_experts(E, N, D, bias=bias)
    _, g = compare_grads(x, w1, w2, b1, b2, out.plan, extra=(router.weight_ED,))
    assert g[-1].abs().sum() > 0  # the router learns through dS


@pytest.mark.parametrize("cfg", ROUTINGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("case", ["empty_experts", "one_token", "k_equals_e", "skewed"])
def test_grads_edge_cases(cfg, case):
    D, N = 10, 4
    if case == "empty_experts":  # experts 0..2 are never a top-K pick
        T, E, K, skew = 48, 8, 2, torch.tensor([-1e4] * 3 + [0.0] * 5, dtype=torch.float64)
    elif case == "one_token":
        T, E, K, skew = 1, 6, 2, None
    elif case == "k_equals_e":
        T, E, K, skew = 20, 4, 4, None
    else:  # every token's first pick is expert 0
        T, E, K, skew = 40, 8, 3, torch.tensor([30.0] + [0.0] * 7, dtype=torch.float64)
    router, x, out = routed(T, D, E, K, tile=4, skew=skew, **cfg)
    counts = out.counts_E
    if case == "empty_experts" and cfg["method"] != "expert_choice":
        assert (counts[:3] == 0).all()
    if case == "skewed" and cfg["method"] == "topk":
        assert counts[0] == T
    w1, w2, b1, b2 = make_experts(E, N, D)
    compare_grads(x, w1, w2, b1, b2, out.plan, extra=(router.weight_ED,))


def test_no_rows_at_all():
    """T=1 with a large tile rounds every expert down to 0: the layer outputs 0 and still backprops."""
    router, x, out = routed(1, 10, 6, 2, tile=8, method="token_rounding", rounding_mode="down")
    assert out.plan.live_rows() == 0
    w1, w2, b1, b2 = make_experts(6, 4, 10)
    y, g = compare_grads(x, w1, w2, b1, b2, out.plan)
    assert (y == 0).all() and all((t == 0).all() for t in g)


def test_gradcheck_on_hand_made_plan():
    """Finite differences, independent of the naive loop: duplicates-free random (token, expert) pairs."""
    T, D, N, E = 7, 5, 3, 4
    gen = torch.Generator().manual_seed(3)
    pairs = torch.rand(T, E, generator=gen) < 0.5
    pairs[:, 0] = False  # expert 0 is empty
    tok, exp = pairs.nonzero(as_tuple=True)
    scores = torch.rand(tok.numel(), generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    w1, w2, b1, b2 = make_experts(E, N, D)

    def f(x, w1, w2, b1, b2, scores):
        return reference.experts(x, w1, w2, build_plan(tok, exp, scores, T, E), b1, b2)

    assert torch.autograd.gradcheck(f, (x, w1, w2, b1, b2, scores))


def test_bf16_close_to_fp32():
    T, D, N, E, K = 96, 64, 32, 8, 2
    torch.manual_seed(0)
    x32 = torch.randn(T, D)
    w1, w2, b1, b2 = make_experts(E, N, D, dtype=torch.float32)
    plan = plan_from_topk(torch.randn(T, E).topk(K, -1).indices, torch.rand(T, K).softmax(-1), E)
    plan = plan.with_scores(plan.scores_R.requires_grad_())
    bf = lambda t: t.detach().to(torch.bfloat16).requires_grad_()  # noqa: E731
    ins32 = [x32.requires_grad_(), w1, w2, b1, b2]
    ins16 = [bf(t) for t in ins32]
    dout = torch.randn(T, D)
    out32 = reference.experts(*ins32[:3], plan, *ins32[3:])
    out16 = reference.experts(*ins16[:3], plan, *ins16[3:])
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out32, rtol=2e-2, atol=2e-2 * out32.abs().max().item())
    g32 = torch.autograd.grad(out32, ins32 + [plan.scores_R], dout)
    g16 = torch.autograd.grad(out16, ins16 + [plan.scores_R], dout.bfloat16())
    for a, b, inp in zip(g16, g32, ins16 + [plan.scores_R]):
        assert a.dtype == inp.dtype  # grads come back in the input's dtype
        rel = (a.float() - b).norm() / b.norm()
        assert rel < 2e-2, rel


# ---------------------------------------------------------------- memory


def reference_saved(T, d, n, E, K):
    x, w1, w2, plan = random_problem(T, d, n, E, K, torch.bfloat16)
    nbytes, _ = saved_tensor_bytes(lambda: reference.experts(x, w1, w2, plan), (w1, w2))
    return nbytes, plan


@pytest.mark.parametrize("T,d,n,E,K", [(256, 64, 32, 8, 2), (128, 96, 16, 16, 4), (1, 32, 8, 4, 4)])
def test_reference_saves_exactly_x_h_and_plan(T, d, n, E, K):
    nbytes, plan = reference_saved(T, d, n, E, K)
    assert nbytes == formula_bytes(T, d, n, K) + plan.nbytes


def test_saved_bytes_with_rounded_plan():
    """Under token rounding R != TK; H is then 4Rn bytes (2 bytes x R rows x 2n)."""
    T, d, n, E, K = 128, 32, 16, 8, 2
    router, x, out = routed(T, d, E, K, tile=16, method="token_rounding", rounding_mode="up")
    R = out.plan.num_rows
    assert R > T * K
    xb = x.detach().bfloat16().requires_grad_()
    w1, w2, _, _ = make_experts(E, n, d, dtype=torch.bfloat16, bias=False)
    nbytes, _ = saved_tensor_bytes(lambda: reference.experts(xb, w1, w2, out.plan), (w1, w2))
    assert nbytes == 2 * T * d + 4 * R * n + out.plan.nbytes


def test_activation_bytes_do_not_depend_on_granularity():
    """Halving n while doubling E and K keeps X + H constant (the plan grows with K: one index per row)."""
    T, d = 256, 64
    held = []
    for n, E, K in ((64, 8, 2), (32, 16, 4), (16, 32, 8)):
        nbytes, plan = reference_saved(T, d, n, E, K)
        held.append(nbytes - plan.nbytes)
    assert held == [held[0]] * 3 and held[0] == 2 * T * d + 4 * T * 2 * 64


def test_naive_holds_more():
    T, d, n, E, K = 256, 64, 32, 8, 2
    x, w1, w2, plan = random_problem(T, d, n, E, K, torch.bfloat16)
    ref, _ = saved_tensor_bytes(lambda: reference.experts(x, w1, w2, plan), (w1, w2))
    nai, _ = saved_tensor_bytes(lambda: naive.experts(x, w1, w2, plan), (w1, w2))
    assert nai > ref + 2 * T * K * d  # at least the gathered X (or Y) on top
