"""Fuzzed shapes for every expert backend: each one matches the fp32 reference or refuses upfront.

Shapes: an expert with no rows, one token, K = E, one expert, E not a power of two (96), d and
n that are not multiples of the kernels' tiles (200, 72), and d or n not a multiple of 8 (rows
that are not 16-byte aligned, which TMA cannot take). `refusal(backend, d, n)` lists what a
backend must refuse, with a ValueError naming the dimension and what to use instead; every
other (backend, shape) must match O, dX, dW1, dW2 and dS of the reference run in fp32 on the
same bf16 values (relative error <= 1e-2), and give exact zeros to experts without rows.

On a GPU every forward and every backward starts from poisoned memory: each free block of the
CUDA caching allocator is filled with 0xFF bytes (NaN in bf16 and fp32, -1 in int32), so an
output element that a kernel never writes reads as NaN; the triton backend's own buffers are
poisoned as well (conftest `poison`). The reference cases run on the CPU in CI (no poisoning
there: the CPU allocator cannot be primed), plus the validation of the cute and triton wrappers.
Run on the GPU machine with: PYTHONPATH=. python -m pytest tests/kernels/test_fuzz_shapes.py -m gpu
"""
from __future__ import annotations


import pytest
import torch

from sonic.kernels import BACKENDS, naive, reference
from sonic.routing.plan import RoutingPlan, plan_from_topk

BF16_TOL = 1e-2

SHAPES = {  # name: (T, d, n, E, K, routing)
    "empty_experts": (200, 64, 32, 8, 2, "empty"),
    "one_token": (1, 64, 32, 8, 2, "uniform"),
    "k_equals_e": (24, 64, 32, 4, 4, "uniform"),
    "one_expert": (40, 64, 32, 1, 1, "uniform"),
    "e96": (300, 64, 32, 96, 4, "skewed"),
    "ragged_d200_n72": (150, 200, 72, 6, 2, "skewed"),
    "d100": (64, 100, 32, 4, 2, "uniform"),
    "n36": (64, 64, 36, 4, 2, "uniform"),
}


def refusal(backend: str, d: int, n: int) -> str | None:
    """The ValueError message (regex) `backend` must raise for this shape, or None if it must run it."""
    if backend == "cute" and d % 8:
        return rf"model\.dim % 8 == 0.*d={d}.*kernel_backend=triton"
    if backend == "cute" and n % 8:
        return rf"moe\.expert_dim % 8 == 0.*n={n}.*kernel_backend=triton"
    return None


def make_plan(T: int, E: int, K: int, routing: str, device, gen) -> RoutingPlan:
    logits_TE = torch.randn(T, E, generator=gen)
    if routing == "empty":  # only every third expert receives rows
        logits_TE[:, torch.arange(E) % 3 != 0] = -1e4
    elif routing == "skewed":  # most rows on the first two experts
        logits_TE[:, :2] += 3.0
    top, idx = logits_TE.to(device).topk(K, dim=-1)
    return plan_from_topk(idx, top.softmax(-1), E)


def problem(name: str, device, dtype=torch.bfloat16):
    T, D, N, E, K, routing = SHAPES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(device, dtype)  # noqa: E731
    x_TD, dout_TD = rnd(T, D), rnd(T, D)
    w1_EFD, w2_EDN = rnd(E, 2 * N, D, scale=D ** -0.5), rnd(E, D, N, scale=N ** -0.5)
    return x_TD, w1_EFD, w2_EDN, make_plan(T, E, K, routing, device, gen), dout_TD


def poison_cuda_cache() -> None:
    """Fill every free block of the CUDA caching allocator with 0xFF bytes (NaN / -1)."""
    torch.cuda.synchronize()
    held = [torch.full((1 << 20,), 255, dtype=torch.uint8, device="cuda") for _ in range(8)]  # small pool
    for seg in torch.cuda.memory_snapshot():
        for block in seg["blocks"]:
            # a request of exactly this size lands in this block's pool (small pool: <= 1 MiB)
            if block["state"] == "inactive" and (seg["segment_type"] == "large") == (block["size"] > 1 << 20):
                held.append(torch.full((block["size"],), 255, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    del held


def run(fn, x_TD, w1_EFD, w2_EDN, plan: RoutingPlan, dout_TD, poison: bool = False) -> dict:
    leaves = [t.detach().clone().requires_grad_() for t in (x_TD, w1_EFD, w2_EDN)]
    scores_R = plan.scores_R.detach().clone().requires_grad_()
    if poison:
        poison_cuda_cache()
    out_TD = fn(*leaves, plan.with_scores(scores_R))
    if poison:
        poison_cuda_cache()
    out_TD.backward(dout_TD.to(out_TD.dtype))
    return {"out": out_TD.detach(), "dx": leaves[0].grad, "dw1": leaves[1].grad, "dw2": leaves[2].grad,
            "ds": scores_R.grad}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_against_fp32_reference(name: str, fn, device, poison: bool) -> None:
    x_TD, w1_EFD, w2_EDN, plan, dout_TD = problem(name, device)
    got = run(fn, x_TD, w1_EFD, w2_EDN, plan, dout_TD, poison=poison)
    ref = run(reference.experts, x_TD.float(), w1_EFD.float(), w2_EDN.float(), plan, dout_TD.float())
    for key, want in ref.items():
        have = got[key]
        assert have.shape == want.shape, key
        assert torch.isfinite(have).all(), f"{name} {key}: unwritten (poisoned) or non-finite elements"
        err = rel_err(have, want)
        assert err <= BF16_TOL, f"{name} {key}: relative error {err:.2e}"
    empty = (plan.counts_E() == 0).nonzero().flatten()
    assert (got["dw1"][empty] == 0).all() and (got["dw2"][empty] == 0).all(), f"{name}: empty experts' grads"
    if SHAPES[name][-1] == "empty":
        assert empty.numel() > 0


# --------------------------------------------------------------------------- CPU (CI)
@pytest.mark.parametrize("name", SHAPES)
def test_reference_on_cpu(name):
    """bf16 vs fp32 reference, and the fp64 reference vs autograd through the naive loop."""
    check_against_fp32_reference(name, reference.experts, torch.device("cpu"), poison=False)
    x_TD, w1_EFD, w2_EDN, plan, dout_TD = problem(name, "cpu", torch.float64)
    ours = run(reference.experts, x_TD, w1_EFD, w2_EDN, plan, dout_TD)
    theirs = run(naive.experts, x_TD, w1_EFD, w2_EDN, plan, dout_TD)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-10, atol=1e-12, msg=f"{name} {key}")


@pytest.mark.parametrize("name", SHAPES)
def test_cute_validation_matches_the_refusal_table(name):
    """cute's upfront checks (no cutlass or GPU needed) refuse exactly the shapes listed in `refusal`."""
    from sonic.kernels.cute import check_inputs

    x_TD, w1_EFD, w2_EDN, plan, _ = problem(name, "cpu")
    why = refusal("cute", x_TD.shape[1], w2_EDN.shape[2])
    if why is None:
        check_inputs(x_TD, w1_EFD, w2_EDN, plan)
    else:
        with pytest.raises(ValueError, match=why):
            check_inputs(x_TD, w1_EFD, w2_EDN, plan)


def test_cute_validation_other_refusals():
    from sonic.kernels.cute import check_inputs

    x_TD, w1_EFD, w2_EDN, plan, _ = problem("ragged_d200_n72", "cpu")
    T, D = x_TD.shape
    flat = torch.empty(T * D + 1, dtype=x_TD.dtype)
    shifted_TD = flat[1:].view(T, D)  # contiguous, 2 bytes past a 16-byte boundary
    shifted_TD.copy_(x_TD)
    with pytest.raises(ValueError, match=r"16-byte aligned.*x_TD.*clone"):
        check_inputs(shifted_TD, w1_EFD, w2_EDN, plan)
    check_inputs(x_TD[:, ::1], w1_EFD, w2_EDN, plan)  # a view that is aligned is fine
    with pytest.raises(ValueError, match="plan is for"):
        check_inputs(x_TD[:-1], w1_EFD, w2_EDN, plan)
    with pytest.raises(ValueError, match="bf16/fp16"):
        check_inputs(x_TD.float(), w1_EFD.float(), w2_EDN.float(), plan)
    with pytest.raises(ValueError, match="biases.*triton"):
        check_inputs(x_TD, w1_EFD, w2_EDN, plan, b1_EF=torch.zeros(w1_EFD.shape[:2], dtype=x_TD.dtype))


def test_triton_refuses_cpu_tensors(monkeypatch):
    from sonic.kernels.triton import experts

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter does run on the CPU
    x_TD, w1_EFD, w2_EDN, plan, _ = problem("one_token", "cpu")
    with pytest.raises(ValueError, match=r"CUDA tensors.*kernel_backend=reference"):
        experts(x_TD, w1_EFD, w2_EDN, plan)


# --------------------------------------------------------------------------- GPU
def _cute_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    from sonic.kernels import cute

    return cute.unavailable_reason(torch.device("cuda"))


GPU_BACKENDS = [
    pytest.param("reference", marks=pytest.mark.gpu),
    pytest.param("triton", marks=pytest.mark.gpu),
    pytest.param("cute", marks=[pytest.mark.gpu, pytest.mark.skipif(_cute_reason() is not None,
                                                                     reason=str(_cute_reason()))]),
]


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_backend_matches_or_refuses(backend, name, request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if backend == "triton":
        request.getfixturevalue("triton_device")  # skips where triton cannot run
        request.getfixturevalue("poison")
    fn = BACKENDS.load(backend).experts
    device = torch.device("cuda")
    _, D, N, *_ = SHAPES[name]
    why = refusal(backend, D, N)
    if why is not None:
        x_TD, w1_EFD, w2_EDN, plan, _ = problem(name, device)
        with pytest.raises(ValueError, match=why):
            fn(x_TD, w1_EFD, w2_EDN, plan)
        return
    check_against_fp32_reference(name, fn, device, poison=True)
