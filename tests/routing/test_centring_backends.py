"""The triton routing backend's prefix centring (sonic/kernels/triton/centring.py) against the definition
(sonic/routing/scores.py): c and its mean square, the backward, and the router logits with their gradients,
for sequences and feature widths that do and do not fill the kernels' tiles. On the GPU with every output
buffer poisoned, and on the CPU through Triton's interpreter (TRITON_INTERPRET=1). bf16 is compared to within
one bf16 step: the interpreter's fp32 -> bf16 casts truncate, and on the GPU the definition's cumsum adds in
another order."""
from __future__ import annotations

import pytest
import torch

from sonic.routing import scores
from tests.helpers import run_in_triton_interpreter

# (sequences, seq_len, D): one tile; several chunks with a partial last chunk and feature block; tiny
CASES = [(3, 64, 64), (2, 150, 100), (1, 5, 8), (4, 128, 192)]


def make_x(B: int, S: int, D: int, dtype, device, seed: int) -> torch.Tensor:
    """Tokens plus a large per-sequence shared vector: what the centring is there to remove."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, D, generator=gen) + 4 * torch.randn(B, 1, D, generator=gen)
    return x.reshape(B * S, D).to(dtype).to(device)


def check_parity(device: str, cases=CASES, dtypes=(torch.float32, torch.bfloat16)) -> None:
    from sonic.kernels.triton import routing as fused

    for B, S, D in cases:
        for dtype in dtypes:
            what = f"B={B} S={S} D={D} {dtype}"
            seed = B * 1000 + S + D
            x = make_x(B, S, D, dtype, device, seed)
            gen = torch.Generator().manual_seed(seed + 1)
            dc = torch.randn(B * S, D, generator=gen).to(dtype).to(device)
            alpha = torch.randn(B * S, generator=gen).to(device)
            w = (torch.randn(16, D, generator=gen) * D ** -0.5).to(dtype).to(device)
            dlogits = torch.randn(B * S, 16, generator=gen).to(device)

            c, ms = fused.prefix_centre(x, S)
            c_ref, ms_ref = scores.prefix_centre(x, S)
            assert c.dtype == dtype and ms.dtype == torch.float32
            # bf16: c within one rounding step (8 significant bits; fp32 sums in another order round a value near
            # the midpoint the other way, and the interpreter truncates)
            step = 1e-4 if dtype == torch.float32 else 2 ** -7  # fp32: sums of up to 4096 in another order
            torch.testing.assert_close(c.float(), c_ref.float(), rtol=step, atol=step, msg=what)
            torch.testing.assert_close(ms, ms_ref.float(), rtol=2 * step, atol=step, msg=what)  # a sum of squares
            # the backward on the same c, so that only the scan differs
            dx = fused.prefix_centre_backward(dc, c_ref, alpha, S)
            dx_ref = scores.prefix_centre_backward(dc, c_ref, alpha, S)
            assert dx.dtype == dtype
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(dx.float(), dx_ref.float(), rtol=tol, atol=tol * dx_ref.abs().max().item(),
                                       msg=what)
            # the router's logits and gradients through each backend's scan
            grads = {}
            for name, ops in (("fused", fused), ("torch", None)):
                xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
                logits = scores.PrefixCentredScores()(xg, wg, S, ops)
                grads[name] = (logits.detach(), *torch.autograd.grad((logits * dlogits).sum(), (xg, wg)))
            for got, want, field in zip(grads["fused"], grads["torch"], ("logits", "dx", "dW")):
                scale = want.abs().max().item()
                torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale,
                                           msg=f"{field}: {what}")


def _interpreter_main() -> None:
    from tests.helpers import patch_triton_interpreter

    patch_triton_interpreter()
    check_parity("cpu")
    print("centring interpreter ok")


@pytest.mark.slow
def test_triton_centring_matches_torch_in_the_interpreter():
    run_in_triton_interpreter("import tests.routing.test_centring_backends as t; t._interpreter_main()",
                              "centring interpreter ok")


@pytest.mark.gpu
def test_triton_centring_matches_torch_on_gpu(triton_device, poison):
    check_parity("cuda", CASES + [(4, 4096, 1536)])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_prefix_scores_keep_no_centred_copy_for_backward(compiled):
    """The centred c is recomputed in backward: every (T, D) tensor autograd keeps is x itself (which the
    experts keep anyway), so the router adds only T-sized and T x E tensors to the block's held memory. Also
    under torch.compile with inductor's partitioner (min-cut), which merged the recompute with the forward's
    c and saved it while the centring was traceable ops."""
    from functorch.compile import min_cut_rematerialization_partition, nop
    from torch._dynamo.backends.common import aot_autograd

    B, S, D, E = 2, 16, 32, 8
    x = torch.randn(B * S, D, requires_grad=True)
    w = torch.randn(E, D, requires_grad=True)

    def logits(x, w):
        return scores.PrefixCentredScores()(x, w, S) * 2.0

    if compiled:
        torch._dynamo.reset()
        backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=min_cut_rematerialization_partition)
        logits = torch.compile(logits, backend=backend, fullgraph=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = logits(x, w)
    big = [t for t in saved if t.numel() >= B * S * D]
    assert big and all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in big), \
        [tuple(t.shape) for t in big]
    out.sum().backward()
    assert x.grad is not None and w.grad is not None
    torch._dynamo.reset()
