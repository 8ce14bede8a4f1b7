"""The torch._grouped_mm baseline backend against the reference (CPU in fp32, GPU in bf16)."""
from __future__ import annotations

import pytest
import torch

from sonic.kernels import grouped_mm, reference
from sonic.routing.plan import build_plan, plan_from_mask, plan_from_topk

needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")


def problem(T, D, N, E, K, bias, dtype, device, seed, skew=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=gen, device=device) * scale).to(dtype)  # noqa: E731
    x = rnd(T, D)
    w1, w2 = rnd(E, 2 * N, D, scale=D ** -0.5), rnd(E, D, N, scale=N ** -0.5)
    b1, b2 = (rnd(E, 2 * N, scale=0.1), rnd(E, D, scale=0.1)) if bias else (None, None)
    logits = torch.randn(T, E, generator=gen, device=device)
    if skew:
        logits[:, : E // 2] -= 1e4  # half the experts empty
    top, idx = logits.topk(K, dim=-1)
    return x, w1, w2, b1, b2, plan_from_topk(idx, top.softmax(-1), E), rnd(T, D)


def grads(fn, x, w1, w2, b1, b2, plan, dout):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, w1, w2, b1, b2)]
    scores = plan.scores_R.detach().clone().requires_grad_()
    out = fn(*leaves[:3], plan.with_scores(scores), leaves[3], leaves[4])
    out.backward(dout)
    return [out.detach()] + [None if t is None else t.grad for t in leaves] + [scores.grad]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(device, dtype, tol, **shape):
    x, w1, w2, b1, b2, plan, dout = problem(device=device, dtype=dtype, **shape)
    got = grads(grouped_mm.experts, x, w1, w2, b1, b2, plan, dout)
    up = lambda t: None if t is None else t.float()  # noqa: E731
    want = grads(reference.experts, up(x), up(w1), up(w2), up(b1), up(b2), plan, dout.float())
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if b is not None:
            assert rel_err(a, b) <= tol, (i, rel_err(a, b))


@needs_grouped_mm
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("skew", [False, True])
def test_cpu_matches_reference(bias, skew):
    check("cpu", torch.float32, 1e-5, T=64, D=32, N=16, E=6, K=2, bias=bias, seed=0, skew=skew)


@needs_grouped_mm
@pytest.mark.parametrize("padding", [0, 13])
def test_cpu_variable_rows_per_token(padding):
    """Token-rounding-like plans (some tokens routed to no expert, and padded as token rounding pads them:
    sonic/routing/plan.py) go through unchanged, expert biases included."""
    T, D, N, E = 40, 32, 16, 5
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(T, E, generator=gen) < 0.3
    mask[0] = False
    if padding:
        plan = plan_from_mask(mask.T.contiguous(), torch.rand(T, E, generator=gen), int(mask.sum()) + padding)
        assert plan.num_rows > plan.live_rows()
    else:
        tok, exp = mask.nonzero(as_tuple=True)
        plan = build_plan(tok, exp, torch.rand(tok.numel(), generator=gen), T, E)
    x, w1, w2, b1, b2, _, dout = problem(T, D, N, E, 2, True, torch.float32, "cpu", 4)
    got = grads(grouped_mm.experts, x, w1, w2, b1, b2, plan, dout)
    want = grads(reference.experts, x, w1, w2, b1, b2, plan, dout)
    for a, b in zip(got, want):
        if b is not None:
            assert rel_err(a, b) <= 1e-5


@pytest.mark.gpu
@needs_grouped_mm
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_bf16_matches_reference(bias):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reason = grouped_mm.unavailable_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    check("cuda", torch.bfloat16, 1e-2, T=512, D=256, N=128, E=8, K=2, bias=bias, seed=1, skew=True)
