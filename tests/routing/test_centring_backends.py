"""The triton routing backend's prefix centring (sonic/kernels/triton/centring.py) against the definition
(sonic/routing/scores.py): the logits and rstd, the backward, and the router's logits and gradients through
autograd, for sequences, feature widths and expert counts that do and do not fill the kernels' tiles. On the
GPU with every output buffer poisoned, and on the CPU through Triton's interpreter (TRITON_INTERPRET=1). bf16
is compared to within one bf16 step of c, relative to the largest value."""
from __future__ import annotations

import itertools

import pytest
import torch

from sonic.routing import scores
from tests.helpers import run_in_triton_interpreter, saved_for_backward

# (sequences, seq_len, D): one tile; several chunks with a partial last chunk and feature block; tiny
CASES = [(3, 64, 64), (2, 150, 100), (1, 5, 8), (4, 128, 192)]


def make_x(B: int, S: int, D: int, dtype, device, seed: int) -> torch.Tensor:
    """Tokens plus a large per-sequence shared vector: what the centring is there to remove."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, D, generator=gen) + 4 * torch.randn(B, 1, D, generator=gen)
    return x.reshape(B * S, D).to(dtype).to(device)


def check_parity(device: str, cases=CASES, dtypes=(torch.float32, torch.bfloat16), num_experts=(16,)) -> None:
    from sonic.kernels.triton import routing as fused

    for (B, S, D), E, dtype in itertools.product(cases, num_experts, dtypes):
        what = f"B={B} S={S} D={D} E={E} {dtype}"
        seed = B * 1000 + S + D + E
        x = make_x(B, S, D, dtype, device, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        w = (torch.randn(E, D, generator=gen) * D ** -0.5).to(dtype).to(device)
        dlogits = torch.randn(B * S, E, generator=gen).to(device)
        # fp32: sums of up to 4096 in another order; bf16: c within one rounding step (the definition's cumsum adds
        # in another order, so a value near a rounding midpoint may round the other way), which moves W c by that
        tol = 1e-4 if dtype == torch.float32 else 2e-2

        def close(got, want, field):
            assert got.dtype == want.dtype, (field, got.dtype, want.dtype)
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item(),
                                       msg=f"{field}: {what}")

        logits, rstd = fused.prefix_centred_logits(x, w, S)
        logits_ref, rstd_ref = scores.prefix_centred_logits(x, w, S)
        close(logits, logits_ref, "logits")
        close(rstd, rstd_ref, "rstd")
        # the backward from the same forward outputs, so that only the backward differs
        dx, dw = fused.prefix_centred_logits_backward(dlogits, x, w, rstd_ref, S)
        dx_ref, dw_ref = scores.prefix_centred_logits_backward(dlogits, x, w, rstd_ref, S)
        close(dx, dx_ref, "dx")
        close(dw, dw_ref, "dW")
        # the router's logits and gradients through each backend
        grads = {}
        for name, ops in (("fused", fused), ("torch", None)):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = scores.PrefixCentredScores()(xg, wg, S, ops)
            grads[name] = (out.detach(), *torch.autograd.grad((out * dlogits).sum(), (xg, wg)))
        for got, want, field in zip(grads["fused"], grads["torch"], ("autograd logits", "autograd dx", "autograd dW")):
            close(got, want, field)


def check_cancellation(device: str, num_experts=(16, 300)) -> None:
    """A shared vector 30x the token part, as deep layers' hidden states carry: the fused forward forms |c|^2 and W c
    from products of x, whose shared parts cancel, so it must keep them exact in fp32 (the carry's low bits
    included) to stay within the bf16 definition's own distance from fp64."""
    from sonic.kernels.triton import routing as fused

    B, S, D = 2, 256, 128
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(B, S, D, generator=gen) + 30 * torch.randn(B, 1, D, generator=gen)).reshape(B * S, D)
    x = x.bfloat16().to(device)
    for E in num_experts:
        w = (torch.randn(E, D, generator=gen) * D ** -0.5).bfloat16().to(device)
        want = scores.prefix_centred_logits(x.double(), w.double(), S)
        for got, exact, field in zip(fused.prefix_centred_logits(x, w, S), want, ("logits", "rstd")):
            err = ((got.double() - exact).norm() / exact.norm()).item()
            assert err < 2e-3, (field, E, err)  # the bf16 definition's: 2.4e-4 (rstd), 1.6e-3 (logits)


def _interpreter_main() -> None:
    from tests.helpers import patch_triton_interpreter

    from sonic.kernels.triton import centring

    patch_triton_interpreter()
    assert 40 <= centring.TILE_MAX_E < 300  # both of the forward's ways: the tile kernel, then by linearity
    check_parity("cpu", num_experts=(16, 40))
    check_parity("cpu", [(1, 600, 24)], num_experts=(300,))  # backward 38 chunks of 16: the scans carry across steps
    check_cancellation("cpu")
    print("centring interpreter ok")


@pytest.mark.slow
def test_triton_centring_matches_torch_in_the_interpreter():
    run_in_triton_interpreter("import tests.routing.test_centring_backends as t; t._interpreter_main()",
                              "centring interpreter ok")


@pytest.mark.gpu
def test_triton_centring_matches_torch_on_gpu(triton_device, poison):
    check_parity("cuda", num_experts=(40,))  # the tile kernel; 512, below: by linearity
    check_parity("cuda", [(2, 150, 100)], num_experts=(512,))  # the largest tiles' configuration
    check_parity("cuda", [(4, 4096, 1536)], num_experts=(128,), dtypes=(torch.bfloat16,))  # sonic_7b's router
    check_cancellation("cuda")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_prefix_scores_keep_no_centred_copy_for_backward(compiled):
    """The centred c is recomputed in backward: every (T, D) tensor autograd keeps is x itself (which the
    experts keep anyway), so the router adds only T-sized and T x E tensors to the block's held memory. Also
    under torch.compile with inductor's partitioner (min-cut), which merged the recompute with the forward's
    c and saved it while the centring was traceable ops."""
    B, S, D, E = 2, 16, 32, 8
    x = torch.randn(B * S, D, requires_grad=True)
    w = torch.randn(E, D, requires_grad=True)
    out, saved = saved_for_backward(lambda x, w: scores.PrefixCentredScores()(x, w, S) * 2.0, x, w, compiled=compiled)
    big = [t for t in saved if t.numel() >= B * S * D]
    assert big and all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in big), \
        [tuple(t.shape) for t in big]
    out.sum().backward()
    assert x.grad is not None and w.grad is not None
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_triton_centring_keeps_no_centred_copy_for_backward(triton_device, compiled):
    """The same with the triton backend, whose op torch.compile traces into (sonic/ops.py): its kernels never
    write c, and the partitioner, which now sees them, must keep nothing T x D but x either."""
    from sonic.kernels.triton import routing as fused

    B, S, D, E = 2, 256, 128, 16
    x = torch.randn(B * S, D, device="cuda", requires_grad=True)
    w = torch.randn(E, D, device="cuda", requires_grad=True)
    out, saved = saved_for_backward(lambda x, w: scores.PrefixCentredScores()(x, w, S, fused) * 2.0, x, w,
                                    compiled=compiled)
    big = [t for t in saved if t.numel() >= B * S * D]
    assert big and all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in big), \
        [tuple(t.shape) for t in big]
    out.sum().backward()
    want = scores.prefix_centred_logits(x.detach(), w.detach(), S)[0] * 2.0
    torch.testing.assert_close(out.detach(), want, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
