"""LM head + cross-entropy: loss = mean over labelled tokens of CE(h_TD @ w_VD^T, labels_T).

One function per backend, chosen by `model.loss_backend`, with identical semantics (labels equal
to IGNORE_INDEX count for nothing; a batch with no labels has loss 0):

| name    | what                                                                                  |
|---------|---------------------------------------------------------------------------------------|
| torch   | full logits, then F.cross_entropy in fp32: the reference (materialises T x V in fp32)  |
| chunked | ours: T in chunks; each chunk's logits exist only inside the chunk, and the gradients |
|         | of h and w are computed in the forward pass, so backward is two scalings             |
| liger   | Liger-Kernel's fused linear cross-entropy (the same idea, Triton; `pip install liger-kernel`) |
| cce     | Apple's cut-cross-entropy: logits never leave SRAM (Triton; `pip install cut-cross-entropy`) |

The backends are one Registry (sonic/registry.py), LOSS_BACKENDS; a backend with a package runs
Triton kernels, on CUDA GPUs only.

Legend: T tokens, D hidden, V vocabulary.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from sonic.registry import Entry, Registry

IGNORE_INDEX = -100
LOSS_BACKENDS = Registry("model.loss_backend", [
    Entry("torch", "sonic.models.loss:torch_loss"),
    Entry("chunked", "sonic.models.loss:chunked_loss"),
    Entry("liger", "sonic.models.loss:liger_loss", package="liger_kernel", extra="liger-kernel"),
    Entry("cce", "sonic.models.loss:cce_loss", package="cut_cross_entropy", extra="cut-cross-entropy"),
])
CHUNK_ELEMENTS = 1 << 28  # logits per chunk of the chunked backend: 512 MiB in bf16


def chunk_tokens(V: int) -> int:
    """Tokens per chunk of the chunked backend at vocabulary size V."""
    return max(1, CHUNK_ELEMENTS // V)


def torch_loss(h_TD: Tensor, w_VD: Tensor, labels_T: Tensor) -> Tensor:
    logits_TV = h_TD @ w_VD.T
    return F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX)


def _ce_chunk(logits_CV: Tensor, labels_C: Tensor, inv_count: Tensor) -> tuple[Tensor, Tensor]:
    """Summed CE of one chunk (fp32, fp64 for fp64) and d(mean loss)/d logits in the logits' dtype."""
    logits = logits_CV.to(torch.promote_types(logits_CV.dtype, torch.float32))
    lse_C = logits.logsumexp(-1)
    valid_C = labels_C != IGNORE_INDEX
    target_C = labels_C.clamp_min(0)
    picked_C = logits.gather(1, target_C[:, None])[:, 0]
    loss = torch.where(valid_C, lse_C - picked_C, 0.0).sum()
    onehot_CV = torch.arange(logits.shape[1], device=logits.device) == target_C[:, None]
    grad_CV = (torch.exp(logits - lse_C[:, None]) - onehot_CV.to(logits.dtype)) * (valid_C[:, None] * inv_count)
    return loss, grad_CV.to(logits_CV.dtype)


@functools.cache
def _compiled_ce_chunk():
    # fuses the softmax, one-hot and scaling into two passes over the chunk's logits
    return torch.compile(_ce_chunk, dynamic=True)


def _chunk_fn(logits_dtype: torch.dtype, device: torch.device):
    """The chunk's CE: one Triton program per row for bf16/fp16 logits on CUDA (sonic/kernels/triton/
    cross_entropy.py), torch.compile's kernel for other dtypes there, plain torch elsewhere."""
    if device.type != "cuda":
        return _ce_chunk
    if logits_dtype in (torch.bfloat16, torch.float16):
        from sonic.kernels.triton.cross_entropy import ce_chunk  # noqa: PLC0415 (Triton: CUDA machines only)

        return functools.partial(ce_chunk, ignore_index=IGNORE_INDEX)
    return _compiled_ce_chunk()


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    @torch.autocast("cuda", enabled=False)  # the caller casts h and w to the compute dtype
    @torch.autocast("cpu", enabled=False)
    def forward(ctx, h_TD: Tensor, w_VD: Tensor, labels_T: Tensor) -> Tensor:
        T, V = h_TD.shape[0], w_VD.shape[0]
        chunk = chunk_tokens(V)
        ce = _chunk_fn(torch.promote_types(h_TD.dtype, w_VD.dtype), h_TD.device)
        acc = torch.promote_types(h_TD.dtype, torch.float32)
        inv_count = 1.0 / (labels_T != IGNORE_INDEX).sum().clamp_min(1).to(acc)
        loss = torch.zeros((), dtype=acc, device=h_TD.device)
        grad_h_TD = torch.empty_like(h_TD)
        grad_w_VD = torch.zeros(w_VD.shape, dtype=acc, device=w_VD.device)
        for lo in range(0, T, chunk):
            h_CD = h_TD[lo:lo + chunk]
            loss_c, grad_CV = ce(h_CD @ w_VD.T, labels_T[lo:lo + chunk], inv_count)
            loss += loss_c
            torch.mm(grad_CV, w_VD, out=grad_h_TD[lo:lo + chunk])
            _accumulate_mm(grad_w_VD, grad_CV.T, h_CD)
        ctx.save_for_backward(grad_h_TD, grad_w_VD)
        return loss * inv_count

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_h_TD, grad_w_VD = ctx.saved_tensors
        return grad_h_TD * grad_loss.to(grad_h_TD.dtype), grad_w_VD * grad_loss, None


def _accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, summed over chunks in acc's dtype (fp32). On CUDA cuBLAS adds into acc in the GEMM's
    epilogue: no bf16 product is rounded, written and read back by an add (`python -m bench.loss` times both);
    elsewhere torch has no such GEMM for bf16."""
    if acc.is_cuda and a.dtype != acc.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += a @ b


def chunked_loss(h_TD: Tensor, w_VD: Tensor, labels_T: Tensor) -> Tensor:
    return _ChunkedLinearCE.apply(h_TD, w_VD, labels_T)


def liger_loss(h_TD: Tensor, w_VD: Tensor, labels_T: Tensor) -> Tensor:
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    loss = LigerFusedLinearCrossEntropyFunction.apply(h_TD, w_VD, labels_T, None, None, IGNORE_INDEX)
    loss = loss[0] if isinstance(loss, tuple) else loss
    # liger returns NaN-free 0/0 -> 0 for a batch without labels only in some versions
    return torch.nan_to_num(loss, nan=0.0)


def cce_loss(h_TD: Tensor, w_VD: Tensor, labels_T: Tensor) -> Tensor:
    from cut_cross_entropy import linear_cross_entropy

    # filter_eps=None: exact gradients (the default skips small softmax terms)
    loss = linear_cross_entropy(h_TD, w_VD, labels_T, ignore_index=IGNORE_INDEX, filter_eps=None)
    return torch.nan_to_num(loss, nan=0.0)


def loss_unavailable_reason(name: str, device: torch.device) -> str | None:
    if LOSS_BACKENDS.entries[name].package is None:
        return None  # plain torch runs anywhere
    if device.type != "cuda":
        return f"it runs Triton kernels on CUDA GPUs only (device is {device})"
    return LOSS_BACKENDS.missing(name)


def get_loss_fn(name: str, device: torch.device):
    """The loss function of backend `name` on `device`; a ValueError names why it cannot run."""
    LOSS_BACKENDS.check(name)
    reason = loss_unavailable_reason(name, device)
    if reason is not None:
        raise ValueError(f"model.loss_backend={name!r} cannot run here: {reason}. "
                         f"Use model.loss_backend=chunked or torch.")
    return LOSS_BACKENDS.load(name)
