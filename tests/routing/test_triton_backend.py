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
from sonic.routing.plan import plan_from_pairs
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


def kernel_probs(logits_TE: torch.Tensor, K: int, order: str, renorm: bool) -> torch.Tensor:
    """The softmax the triton route ranks EC candidates by: the select kernel's P, T x E."""
    from sonic.kernels.triton import routing

    T, E = logits_TE.shape
    key_ET, prob_ET = (torch.empty(E, T, dtype=torch.int32, device=logits_TE.device) for _ in range(2))
    routing._select_launch(logits_TE.detach().contiguous(), torch.zeros(E, device=logits_TE.device), K, order, renorm,
                           True, keys=(key_ET, prob_ET))
    return prob_ET.view(torch.float32).T.contiguous()


def check_rounding_parity(device: str, matrices, modes=MODES, orders=ORDERS[:1]) -> None:
    """Token rounding's route, triton against the definition, for every rounding mode on the rounding tests'
    matrices (ties, K = 1, empty experts, T < tile, one expert preferred by all): the torch backend's top-K, and
    the torch selection (token_rounding.select_rows, with the same stochastic draw) on the triton top-K and the
    softmax the kernel ranks by (torch's to rounding, and P's that are equal in exact arithmetic, of permuted
    rows, can round apart differently in each: the ranking's ties are the kernel's own); nearest_score takes the
    torch selection on torch's softmax. The same f_e, c_e and plan (padding included), the rows' gates, and d logits
    through them, the top-K gates and the losses, against torch autograd through the same rows."""
    from sonic.kernels.triton import routing
    from sonic.routing import token_rounding

    for name in matrices:
        logits_TE, K, M = rounding_logits(name)
        T, E = logits_TE.shape
        for mode in modes:
            residual_E = (torch.randint(-M // 2, M // 2 + 1, (E,), generator=torch.Generator().manual_seed(T))
                          .to(device) if mode == "balance" else None)
            for order, renorm in orders:
                what = f"{name} {mode} {order} renorm={renorm}"
                logits = logits_TE.to(device).requires_grad_()
                torch.manual_seed(7)
                topk, plan, f_E, c_E = routing.route_token_rounding(logits, torch.zeros(E, device=device), K, order,
                                                                    renorm, M, mode, residual_E)
                assert f_E.dtype == c_E.dtype == torch.int64, what
                probs_TE = logits.detach().float().softmax(-1)
                if mode != "nearest_score":
                    ranked_TE = kernel_probs(logits, K, order, renorm)
                    torch.testing.assert_close(ranked_TE, probs_TE, rtol=1e-5, atol=1e-7, msg=what)
                    probs_TE = ranked_TE
                torch.manual_seed(7)
                pairs_R2, want_f, want_c = token_rounding.select_rows(
                    probs_TE, topk.expert_idx_TK, topk.gates_TK.detach(), residual_E, M, mode, plan.num_rows)
                assert torch.equal(f_E, want_f) and torch.equal(c_E, want_c), what
                want = plan_from_pairs(*pairs_R2.unbind(1), probs_TE.scatter(1, topk.expert_idx_TK, topk.gates_TK))
                for field in FIELDS:
                    assert torch.equal(getattr(plan, field), getattr(want, field)), f"{field}: {what}"
                torch.testing.assert_close(plan.scores_R, want.scores_R, rtol=1e-5, atol=1e-6, msg=what)
                # d logits: the same rows' gates through torch's top-K and softmax
                ref = logits_TE.to(device).requires_grad_()
                ref_topk = token_choice.select_topk(ref, torch.zeros(E, device=device), K, order, renorm)
                assert torch.equal(ref_topk.expert_idx_TK, topk.expert_idx_TK), what
                gate_TE = ref.softmax(-1).scatter(1, ref_topk.expert_idx_TK, ref_topk.gates_TK)
                live = plan.expert_idx_R < E
                ref_scores_R = torch.where(live, gate_TE[plan.token_idx_R.long(), plan.expert_idx_R.clamp(max=E - 1)
                                                         .long()], 0.0)
                grads = []
                for top, scores_R, x in ((topk, plan.scores_R, logits), (ref_topk, ref_scores_R, ref)):
                    gen = torch.Generator().manual_seed(T)
                    rows = torch.randn(plan.num_rows, generator=gen).to(device)
                    grads += torch.autograd.grad(losses(top, E, T, gen) + (scores_R * rows).sum(), x)
                torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5, msg=f"d logits: {what}")


def _interpreter_main() -> None:
    from tests.helpers import patch_triton_interpreter

    patch_triton_interpreter()
    check_parity("cpu", CPU_CASES)
    from sonic.kernels.triton import routing

    assert min(K for _, _, K, *_ in SORT_CASES) >= routing.SORT_FROM_K > max(K for _, _, K, *_ in CPU_CASES)
    check_parity("cpu", SORT_CASES, orders=ORDERS[:1])
    check_rounding_parity("cpu", MATRICES)
    check_rounding_parity("cpu", ("coarse_ties", "k1_topk_softmax"), modes=("nearest",), orders=ORDERS[1:])
    from sonic.kernels.triton import rounding

    with mock.patch.object(rounding, "_RESIDENT_T", 0), mock.patch.object(rounding, "_CHUNK", 64):  # rows in blocks
        check_rounding_parity("cpu", ("coarse_ties", "k1_topk_softmax", "random_large"), modes=("nearest", "up", "down"))
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
    check_rounding_parity("cuda", ("coarse_ties", "k1_topk_softmax"), modes=("nearest",), orders=ORDERS[1:])


def test_auto_picks_torch_on_cpu_and_unknown_backends_fail():
    from sonic.routing import RoutingConfig
    from sonic.routing.backends import resolve_routing_backend

    assert resolve_routing_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="routing.backend='triton' cannot run on cpu"):
        resolve_routing_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="routing.backend='fast' is not one of auto, torch, triton"):
        RoutingConfig(backend="fast")
