"""The triton routing backend against the torch one (the semantics): the same top-K (ties included), gates,
softmax statistics, gradients through the gates, the aux loss and the z-loss, and the same plan, for every
gate order, with and without an expert bias. On the GPU on fresh inputs with every output buffer poisoned,
and on the CPU through Triton's interpreter (TRITON_INTERPRET=1)."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from sonic.routing import token_choice
from sonic.routing.losses import switch_aux_loss, z_loss
from tests.helpers import run_in_triton_interpreter
from tests.routing.test_token_rounding import MATRICES, MODES
from tests.routing.test_token_rounding import _logits as rounding_logits

ORDERS = [("topk_softmax", False), ("softmax_topk", False), ("softmax_topk", True)]
FIELDS = ("token_idx_R", "expert_idx_R", "expert_offsets_E1", "token_offsets_T1", "rows_by_token_R")


def make_logits(T: int, E: int, ties: bool, dtype, device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (T, E), generator=gen).float() if ties else torch.randn(T, E, generator=gen)
    if T > 1:
        logits[T // 2] = 0.0  # a token whose logits all tie
    return logits.to(dtype).to(device)


def losses(topk, E: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """A loss through every differentiable output: the gates, the aux loss (probsum) and the z-loss (lse)."""
    g = torch.randn(topk.gates_TK.shape, generator=gen).to(topk.gates_TK.device)
    picks = torch.randint(1, 50, (E,), generator=gen).to(topk.gates_TK.device)
    return (topk.gates_TK * g).sum() + 3.0 * switch_aux_loss(topk.probsum_E / T, picks) + 0.5 * z_loss(topk.lse_T)


def check_parity(device: str, cases, dtypes=(torch.float32,), orders=ORDERS) -> None:
    from sonic.kernels.triton import routing

    for T, E, K, ties, biased in cases:
        for dtype in dtypes:
            for order, renorm in orders:
                seed = T * 1000 + E * 10 + K
                bias_E = (torch.randn(E, generator=torch.Generator().manual_seed(seed)) * 0.5 if biased
                          else torch.zeros(E)).to(device)
                got, want, grads = {}, {}, {}
                for name, backend in (("triton", routing), ("torch", token_choice)):
                    logits = make_logits(T, E, ties, dtype, device, seed).requires_grad_()
                    topk, plan = backend.route_topk(logits, bias_E, K, order, renorm)
                    loss = losses(topk, E, T, torch.Generator().manual_seed(seed))
                    loss = loss + (plan.scores_R * torch.arange(plan.num_rows, device=device)).sum() * 1e-3
                    (grads[name],) = torch.autograd.grad(loss, logits)
                    (got if name == "triton" else want).update(topk=topk, plan=plan)
                    alone = backend.select_topk(logits, bias_E, K, order, renorm)  # the op the other methods use
                    (grads[name + " alone"],) = torch.autograd.grad(losses(alone, E, T, torch.Generator().manual_seed(
                        seed)), logits)
                    for field in ("expert_idx_TK", "gates_TK", "lse_T", "probsum_E"):
                        torch.testing.assert_close(getattr(alone, field), getattr(topk, field), msg=field)
                what = f"T={T} E={E} K={K} ties={ties} bias={biased} {dtype} {order} renorm={renorm}"
                assert got["topk"].expert_idx_TK.dtype == torch.int64
                assert torch.equal(got["topk"].expert_idx_TK, want["topk"].expert_idx_TK), what
                for field in ("gates_TK", "probsum_E", "lse_T"):
                    torch.testing.assert_close(getattr(got["topk"], field), getattr(want["topk"], field).float(),
                                               rtol=1e-5, atol=1e-5, msg=f"{field}: {what}")
                assert grads["triton"].dtype == dtype
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                for which in ("", " alone"):
                    torch.testing.assert_close(grads["triton" + which].float(), grads["torch" + which].float(),
                                               rtol=tol, atol=tol, msg=f"d logits{which}: {what}")
                for field in FIELDS:
                    assert torch.equal(getattr(got["plan"], field), getattr(want["plan"], field)), f"{field}: {what}"
                torch.testing.assert_close(got["plan"].scores_R, want["plan"].scores_R.float(), rtol=1e-5, atol=1e-6)


CPU_CASES = [(37, 8, 2, False, False), (64, 12, 3, True, True), (5, 3, 3, True, False), (1, 4, 1, False, True),
             (700, 8, 2, True, True)]  # the last: several chunks of the counting sort
# the select kernel's top-K by sorting packed keys (from routing.SORT_FROM_K picks): ties, a partial expert block
SORT_CASES = [(9, 300, 16, True, False), (20, 256, 16, False, True)]
GPU_CASES = CPU_CASES + [(4096, 128, 8, False, True), (1000, 128, 8, True, True), (333, 512, 10, False, True),
                         (257, 64, 4, True, False), (2048, 256, 16, False, False),
                         (20000, 128, 8, False, True)]  # the last: more chunks than one step of the chunk scan
# Every (E, K, order, dtype) compiles its own kernels (~1 s each on an H100): the shapes run in the models'
# dtype and default order, every order in both dtypes on the few cases that reach each kernel path.
GPU_ORDER_CASES = [(700, 8, 2, True, True), (333, 512, 10, False, True)]


def check_rounding_parity(device: str, matrices, modes=MODES) -> None:
    """Token rounding's selection, triton against torch: the same pairs (padding included), f_e and c_e, for
    every rounding mode (nearest_score takes the torch selection inside the triton op), on the rounding tests'
    matrices (ties, K = 1, empty experts, T < tile, one expert preferred by all). The op (on CUDA a graph
    replay) is compared too, except under stochastic rounding, whose replayed draw test_gpu.py checks."""
    from sonic.kernels.triton import rounding
    from sonic.routing import token_rounding

    for name in matrices:
        logits_TE, K, M = rounding_logits(name)
        T, E = logits_TE.shape
        probs_TE = logits_TE.softmax(-1).to(device)
        topk = token_choice.select_topk(logits_TE.to(device), torch.zeros(E, device=device), K, "topk_softmax", False)
        for mode in modes:
            residual_E = (torch.randint(-M // 2, M // 2 + 1, (E,), generator=torch.Generator().manual_seed(T))
                          .to(device) if mode == "balance" else None)
            args = (probs_TE, topk.expert_idx_TK, topk.gates_TK, residual_E, M, mode,
                    token_rounding.max_rows(T, K, E, M, mode))
            torch.manual_seed(7)  # stochastic: the same draw on both sides
            want = token_rounding.select_rows(*args)
            for fn in (rounding.select_rows, rounding.token_rounding_rows)[:1 if mode == "stochastic" else 2]:
                torch.manual_seed(7)
                for field, a, b in zip(("pairs", "f_e", "c_e"), fn(*args), want):
                    assert torch.equal(a, b), f"{field}: {name} {mode} {fn}"


def _interpreter_main() -> None:
    from tests.helpers import patch_triton_interpreter

    patch_triton_interpreter()
    check_parity("cpu", CPU_CASES)
    from sonic.kernels.triton import routing

    assert min(K for _, _, K, *_ in SORT_CASES) >= routing.SORT_FROM_K > max(K for _, _, K, *_ in CPU_CASES)
    check_parity("cpu", SORT_CASES, orders=ORDERS[:1])
    check_rounding_parity("cpu", MATRICES)
    from sonic.kernels.triton import rounding

    with mock.patch.object(rounding, "_RESIDENT_T", 0), mock.patch.object(rounding, "_CHUNK", 64):  # rows in blocks
        check_rounding_parity("cpu", ("coarse_ties", "k1_topk_softmax"), modes=("nearest", "up", "down"))
    print("routing interpreter ok")


@pytest.mark.slow
def test_triton_routing_matches_torch_in_the_interpreter():
    run_in_triton_interpreter("import tests.routing.test_triton_backend as t; t._interpreter_main()",
                              "routing interpreter ok")


@pytest.mark.gpu
def test_triton_routing_matches_torch_on_gpu(triton_device, poison):
    check_parity("cuda", GPU_CASES, dtypes=(torch.bfloat16,), orders=ORDERS[:1])
    check_parity("cuda", GPU_ORDER_CASES, dtypes=(torch.float32, torch.bfloat16))
    check_rounding_parity("cuda", MATRICES + ("sonic_7b", "over_16k_tokens"))


def test_auto_picks_torch_on_cpu_and_unknown_backends_fail():
    from sonic.routing import RoutingConfig
    from sonic.routing.backends import resolve_routing_backend

    assert resolve_routing_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="routing.backend='triton' cannot run on cpu"):
        resolve_routing_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="routing.backend='fast' is not one of auto, torch, triton"):
        RoutingConfig(backend="fast")
