"""The Triton backend against the fp32 reference on the GPU (skipped without CUDA + Triton).

Every case draws fresh random inputs, poisons every buffer the kernels write (NaN / -1),
and compares O, dX, dW1, dW2, db1, db2 and dS with the reference run in fp32 on the same
bf16 values: relative error (Frobenius) <= 1e-2. Also: saved-tensor bytes equal the
reference's, results are bitwise deterministic, the on-device routing builds the same
plan as sonic.routing.plan, and a different routed-row count R never recompiles.
Run on the GPU machine with: PYTHONPATH=. python -m pytest tests/kernels -m gpu
"""
from __future__ import annotations

import zlib

import pytest
import torch

from sonic.kernels import reference
from sonic.routing.plan import RoutingPlan, build_plan, plan_from_topk
from tests.helpers import padded_plan_from_topk, run_in_triton_interpreter

BF16_TOL = 1e-2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_weights(E, N, D, bias, device, gen):
    rnd = lambda *s, scale: (torch.randn(*s, generator=gen, device=device) * scale).to(torch.bfloat16)  # noqa: E731
    w1 = rnd(E, 2 * N, D, scale=D ** -0.5)
    w2 = rnd(E, D, N, scale=N ** -0.5)
    b1 = rnd(E, 2 * N, scale=0.1) if bias else None
    b2 = rnd(E, D, scale=0.1) if bias else None
    return w1, w2, b1, b2


def topk_plan(T, E, K, device, gen, skew=False) -> RoutingPlan:
    logits = torch.randn(T, E, generator=gen, device=device)
    if skew:  # one hot expert, half the experts never chosen
        logits[:, : E // 2] -= 1e4
        logits[:, E - 1] += 4.0
    top, idx = logits.topk(K, dim=-1)
    return plan_from_topk(idx, top.softmax(-1), E)


def variable_plan(T, E, device, gen) -> RoutingPlan:
    """Token-rounding-like routing: each token has 0..E experts, counts are arbitrary."""
    mask = torch.rand(T, E, generator=gen, device=device) < torch.linspace(0.02, 0.6, E, device=device)
    mask[0] = False  # a token with no rows at all
    tok, exp = mask.nonzero(as_tuple=True)
    scores = torch.rand(tok.numel(), generator=gen, device=device)
    return build_plan(tok, exp, scores, T, E)


def padded_plan(T, E, K, device, gen, extra: int) -> RoutingPlan:
    """A top-K plan padded with `extra` rows (sonic/routing/plan.py), as token rounding sizes its plans."""
    top, idx = torch.randn(T, E, generator=gen, device=device).topk(K, dim=-1)
    return padded_plan_from_topk(idx, top.softmax(-1), E, extra)


def run(fn, x, w1, w2, b1, b2, plan, dout):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, w1, w2, b1, b2)]
    scores = plan.scores_R.detach().clone().requires_grad_()
    out = fn(*leaves[:3], plan.with_scores(scores), leaves[3], leaves[4])
    out.backward(dout.to(out.dtype))
    grads = {n: (None if t is None else t.grad) for n, t in zip(("dx", "dw1", "dw2", "db1", "db2"), leaves)}
    return {"out": out.detach(), **grads, "ds": scores.grad}


def fp32(t):
    return None if t is None else t.float()


CASES = {
    # name: (T, D, N, E, K, bias, routing)
    "topk": (512, 256, 128, 8, 2, False, "topk"),
    "bias": (512, 256, 128, 8, 2, True, "topk"),
    "skewed_empty_experts": (700, 256, 128, 16, 4, False, "skew"),
    "one_token": (1, 256, 128, 8, 2, True, "topk"),
    "k_equals_e": (96, 256, 128, 6, 6, False, "topk"),
    "ragged_tiles": (333, 200, 72, 7, 3, True, "topk"),
    "variable_rows": (400, 256, 128, 8, 0, True, "variable"),
    "padded_rows": (300, 256, 128, 8, 2, True, "padded"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_matches_fp32_reference(case, triton_device, poison):
    from sonic.kernels.triton import experts

    T, D, N, E, K, bias, routing = CASES[case]
    gen = torch.Generator(device=triton_device).manual_seed(zlib.crc32(case.encode()))  # hash() varies by process
    x = torch.randn(T, D, generator=gen, device=triton_device).to(torch.bfloat16)
    w1, w2, b1, b2 = make_weights(E, N, D, bias, triton_device, gen)
    if routing == "variable":
        plan = variable_plan(T, E, triton_device, gen)
    elif routing == "padded":
        plan = padded_plan(T, E, K, triton_device, gen, extra=200)
    else:
        plan = topk_plan(T, E, K, triton_device, gen, skew=routing == "skew")
    dout = torch.randn(T, D, generator=gen, device=triton_device).to(torch.bfloat16)

    got = run(experts, x, w1, w2, b1, b2, plan, dout)
    ref = run(reference.experts, fp32(x), fp32(w1), fp32(w2), fp32(b1), fp32(b2), plan, dout.float())
    for name, want in ref.items():
        have = got[name]
        if want is None:
            assert have is None, name
            continue
        assert have.dtype == (torch.float32 if name == "ds" else torch.bfloat16), name
        assert torch.isfinite(have).all(), f"{name}: unwritten (poisoned) or non-finite elements"
        err = rel_err(have, want)
        # dS = <dA', A> with A from the bf16 H the kernels keep (the paper's contract) against the fp32 H of
        # the fp32 reference: each row's error is ~bf16 epsilon, and over a handful of rows nothing averages
        tol = BF16_TOL if name != "ds" or have.numel() >= 64 else 2 * BF16_TOL
        assert err <= tol, f"{case} {name}: relative error {err:.2e}"


def _saved_bytes(fn) -> tuple[int, torch.Tensor]:
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


@pytest.mark.gpu
def test_saves_what_the_reference_saves(triton_device):
    from sonic.kernels.triton import experts

    gen = torch.Generator(device=triton_device).manual_seed(0)
    T, D, N, E, K = 512, 256, 128, 8, 2
    x = torch.randn(T, D, generator=gen, device=triton_device).to(torch.bfloat16).requires_grad_()
    w1, w2, b1, b2 = (t.requires_grad_() for t in make_weights(E, N, D, True, triton_device, gen))
    plan = topk_plan(T, E, K, triton_device, gen)
    plan = plan.with_scores(plan.scores_R.requires_grad_())
    ours, out1 = _saved_bytes(lambda: experts(x, w1, w2, plan, b1, b2))
    theirs, out2 = _saved_bytes(lambda: reference.experts(x, w1, w2, plan, b1, b2))
    assert ours == theirs
    # X + H + plan + weights: nothing per-row beyond H (A, Y, gathered X are transients)
    weights = sum(t.numel() * 2 for t in (w1, w2, b1, b2))
    assert ours == x.numel() * 2 + plan.num_rows * 2 * N * 2 + plan.nbytes + weights


@pytest.mark.gpu
def test_deterministic(triton_device):
    from sonic.kernels.triton import experts

    gen = torch.Generator(device=triton_device).manual_seed(1)
    T, D, N, E, K = 700, 256, 128, 16, 4
    x = torch.randn(T, D, generator=gen, device=triton_device).to(torch.bfloat16)
    w1, w2, b1, b2 = make_weights(E, N, D, True, triton_device, gen)
    plan = topk_plan(T, E, K, triton_device, gen, skew=True)
    dout = torch.randn(T, D, generator=gen, device=triton_device).to(torch.bfloat16)
    a = run(experts, x, w1, w2, b1, b2, plan, dout)
    b = run(experts, x, w1, w2, b1, b2, plan, dout)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _jit_entries() -> int:
    import triton

    from sonic.kernels.triton import gemm, routing

    n = 0
    for mod in (gemm, routing):
        for obj in vars(mod).values():
            if isinstance(obj, triton.runtime.JITFunction):
                n += sum(len(cache[0]) for cache in obj.device_caches.values())
    return n


@pytest.mark.gpu
def test_no_recompile_or_retune_across_row_counts(triton_device):
    """Token rounding changes R every step: neither the JIT cache nor the tuner may grow."""
    from sonic.kernels.triton import experts, routing, tuning

    gen = torch.Generator(device=triton_device).manual_seed(2)
    T, D, N, E = 1024, 256, 128, 8
    x = torch.randn(T, D, generator=gen, device=triton_device).to(torch.bfloat16)
    w1, w2, b1, b2 = make_weights(E, N, D, False, triton_device, gen)
    dout = torch.randn(T, D, generator=gen, device=triton_device).to(torch.bfloat16)

    def step(plan):
        run(experts, x, w1, w2, b1, b2, plan, dout)

    no_bias = torch.zeros(E, device=triton_device)
    step(routing.route_topk(torch.randn(T, E, device=triton_device), no_bias, 2, "topk_softmax", False)[1])
    entries, chosen = _jit_entries(), tuning.chosen()
    rows = []
    for i in range(5):
        plan = variable_plan(T, E, triton_device, gen)
        rows.append(plan.num_rows)
        step(plan)
        routing.route_topk(torch.randn(T - 7 * i - 1, E, device=triton_device), no_bias, 2, "topk_softmax",
                           False)  # T varies too
    assert len(set(rows)) >= 4, rows
    assert _jit_entries() == entries, "a different routed-row count recompiled a kernel"
    assert tuning.chosen() == chosen, "a different routed-row count re-tuned"


# ------------------------------------------------------------------ CPU: Triton's interpreter

def _interpreter_main() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: the kernels' indexing on tiny problems.

    The interpreter has no bf16 dot, so fp32 and fp16 are checked; small tiles (16 rows,
    32 columns, 16-deep K) give several tiles per expert, ragged tails and several K steps.
    """
    from sonic.kernels.triton import experts, function, gemm, tuning
    from tests.conftest import poisoned_empty
    from tests.helpers import patch_triton_interpreter

    patch_triton_interpreter()
    function._alloc = poisoned_empty  # this subprocess only: every buffer the kernels write starts NaN / -1

    small = tuning.Config(16, 32, 16, 4, 1)
    for k in tuning.CANDIDATES:
        tuning.CANDIDATES[k] = (small,)
    # the shapes below take both paths of every product that has two: TMA where 16 divides the reduction (varlen-M)
    # and the operand's rows are 16-byte aligned, pointers elsewhere (D 72: up; N 40 and 36: down; 2N 72: dX~; the
    # fp16 A' rows of N 36, 72 bytes: dW2)
    launches = {}
    paths = ("up_proj_kernel", "up_proj_tma_kernel", "varlen_m_gemm_kernel", "varlen_m_tma_kernel", "dh_kernel",
             "varlen_k_gemm_kernel", "varlen_k_tma_kernel")
    for name in paths:
        kernel = getattr(gemm, name)
        setattr(gemm, name, type("Counted", (), {"__getitem__": lambda self, grid, name=name, kernel=kernel: (
            launches.__setitem__(name, launches.get(name, 0) + 1), kernel[grid])[1]})())
    gen = torch.Generator().manual_seed(0)
    for T, D, N, E, K, bias, dtype in [(45, 80, 40, 4, 2, True, torch.float16), (33, 64, 48, 6, 6, False, torch.float32),
                                       (1, 64, 32, 3, 3, True, torch.float32), (20, 72, 36, 5, 2, True, torch.float16)]:
        x = torch.randn(T, D, generator=gen).to(dtype)
        w1, w2 = (torch.randn(E, 2 * N, D, generator=gen) * D ** -0.5).to(dtype), (torch.randn(E, D, N, generator=gen) * N ** -0.5).to(dtype)
        b1, b2 = ((torch.randn(E, 2 * N, generator=gen) * 0.1).to(dtype), (torch.randn(E, D, generator=gen) * 0.1).to(dtype)) if bias else (None, None)
        logits = torch.randn(T, E, generator=gen)
        logits[:, 0] += 2.0  # skewed
        top, idx = logits.topk(K, dim=-1)
        dout = torch.randn(T, D, generator=gen).to(dtype)
        # the top-K plan, and the same rows padded as token rounding pads them (sonic/routing/plan.py)
        for plan in (plan_from_topk(idx, top.softmax(-1), E), padded_plan(T, E, K, "cpu", gen, extra=21)):
            got = run(experts, x, w1, w2, b1, b2, plan, dout)
            f64 = lambda t: None if t is None else t.double()  # noqa: E731
            ref = run(reference.experts, f64(x), f64(w1), f64(w2), f64(b1), f64(b2), plan, dout.double())
            for name, want in ref.items():
                if want is not None:
                    assert torch.isfinite(got[name]).all(), (T, D, N, E, K, plan.num_rows, name)
                    err = rel_err(got[name], want)
                    assert err <= (2e-3 if dtype == torch.float16 else 1e-5), (T, D, N, E, K, name, err)
    assert set(launches) == set(paths), launches
    print("interpreter ok")


@pytest.mark.slow
def test_kernels_in_triton_interpreter():
    """CPU coverage of the kernels' indexing, where Triton is installed (no GPU needed)."""
    run_in_triton_interpreter("import tests.kernels.test_triton as t; t._interpreter_main()", "interpreter ok")
