"""The triton routing backend's logit norm (sonic/kernels/triton/logit_norm.py) against the definition
(sonic/routing/scores.py): y and the kept statistics, the backward from the same saved tensors, and the
router's logit norm through autograd against the definition's own autograd, for sequences and expert counts that
do and do not fill a chunk or an expert block. On the GPU and on the CPU through Triton's interpreter
(TRITON_INTERPRET=1), with every output buffer poisoned on both."""
from __future__ import annotations

import itertools

import pytest
import torch

from sonic.routing import scores
from tests.helpers import run_in_triton_interpreter

# (sequences, seq_len): one chunk; a partial last chunk; tiny; several whole chunks
CASES = [(3, 64), (2, 150), (1, 5), (2, 256)]


def make_logits(B: int, S: int, E: int, dtype, device, seed: int) -> torch.Tensor:
    """Logits with a per-sequence offset and per-expert spreads: what the norm is there to even out."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(B, S, E, generator=gen) * (0.5 + 3 * torch.rand(1, 1, E, generator=gen))
    return (z + 4 * torch.randn(B, 1, E, generator=gen)).reshape(B * S, E).to(dtype).to(device)


def check_parity(device: str, cases=CASES, num_experts=(16,), dtypes=(torch.float32, torch.bfloat16)) -> None:
    from sonic.kernels.triton import routing as fused

    for (B, S), E, dtype in itertools.product(cases, num_experts, dtypes):
        what = f"B={B} S={S} E={E} {dtype}"
        z = make_logits(B, S, E, dtype, device, seed=B * 1000 + S + E)
        dy = torch.randn(B * S, E, generator=torch.Generator().manual_seed(S)).to(device)

        def close(got, want, field, tol=1e-5):
            assert got.dtype == want.dtype and got.shape == want.shape, (field, got.dtype, want.dtype, got.shape)
            torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item(), msg=f"{field}: {what}")

        y, stats = fused.prefix_standardise(z, S)
        y_ref, stats_ref = scores.prefix_standardise(z, S)
        close(y, y_ref, "y")
        close(stats, stats_ref, "stats")
        # the backward from the same saved tensors, so that only the backward differs
        close(fused.prefix_standardise_backward(dy, y_ref, stats_ref, S),
              scores.prefix_standardise_backward(dy, y_ref, stats_ref, S), "dz")
        # through autograd: the op on each backend against the definition's own autograd (the scale held constant)
        want = None
        for name, ops in (("definition", None), ("torch", scores), ("fused", fused)):
            zg = z.clone().requires_grad_()
            out = scores.standardise_by_prefix(zg, S) if ops is None else scores.PrefixStandardisedLogits()(zg, S, ops)
            got = (out.detach(), *torch.autograd.grad((out * dy).sum(), zg))
            if want is None:
                want = got
                continue
            # the fused forward sums in another order, and the backward recovers the scale position by position
            # from y: in fp32 each side drifts by a few ulps per chunk (2e-5 apart at 4096 positions on an H200)
            tol = 1e-5 * max(1.0, S / 256)
            close(got[0], want[0], f"{name} autograd y", tol)
            close(got[1], want[1], f"{name} autograd dz", tol if dtype == torch.float32 else 1e-2)


def _poison() -> None:
    from sonic.kernels.triton import centring, logit_norm
    from tests.conftest import poisoned_empty

    centring._alloc = logit_norm._alloc = poisoned_empty


def _interpreter_main() -> None:
    from tests.helpers import patch_triton_interpreter

    patch_triton_interpreter()
    _poison()
    check_parity("cpu", num_experts=(16, 40))
    check_parity("cpu", [(1, 300)], num_experts=(300,), dtypes=(torch.float32,))  # three expert blocks, 5 chunks
    print("logit norm interpreter ok")


@pytest.mark.slow
def test_triton_logit_norm_matches_torch_in_the_interpreter():
    run_in_triton_interpreter("import tests.routing.test_logit_norm_backends as t; t._interpreter_main()",
                              "logit norm interpreter ok")


@pytest.mark.gpu
def test_triton_logit_norm_matches_torch_on_gpu(triton_device, poison):
    check_parity("cuda", num_experts=(40, 128))
    check_parity("cuda", [(2, 150)], num_experts=(512,))
    check_parity("cuda", [(4, 4096)], num_experts=(128,), dtypes=(torch.float32,))  # sonic_7b's step
