"""One chunk of the chunked LM-head loss (model.loss_backend=chunked, sonic/models/loss.py) on CUDA: per row of
logits, the cross-entropy and d(mean loss)/d logits, in one program.

The semantics are `sonic.models.loss._ce_chunk`'s (which see). A program takes one row: a first pass keeps a
running max and sum of exponentials per lane (fp32), a second pass writes (softmax - onehot) * inv_count in the
logits' dtype; a row (V = 100352 bf16 is 196 KiB) is read from HBM once, the second pass finds it in L2. The
row's loss goes to loss_C and torch sums it (fixed order: deterministic). `python -m bench.loss` times it
against torch.compile's kernel of the same code, which the backend ran before.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_V = 4096
WARPS = 8
# a finite stand-in for -inf in masked lanes: exp(FLOOR - m) is 0, and FLOOR - FLOOR is 0, not NaN
_FLOOR = tl.constexpr(-1e30)


@triton.jit(do_not_specialize=["V"])
def _ce_kernel(logits_ptr, labels_ptr, inv_count_ptr, grad_ptr, loss_ptr, V, IGNORE: tl.constexpr,
               BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * V
    grad_row = grad_ptr + row * V
    offs = tl.arange(0, BLOCK_V)
    m_B = tl.full((BLOCK_V,), _FLOOR, tl.float32)
    s_B = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(logits_row + start + offs, mask=start + offs < V, other=_FLOOR).to(tl.float32)
        m_new = tl.maximum(m_B, x)
        s_B = s_B * tl.exp(m_B - m_new) + tl.exp(x - m_new)
        m_B = m_new
    m = tl.max(m_B, axis=0)
    lse = m + tl.log(tl.sum(s_B * tl.exp(m_B - m), axis=0))
    label = tl.load(labels_ptr + row)
    valid = label != IGNORE
    target = tl.where(valid, label, 0)
    picked = tl.load(logits_row + target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
    scale = tl.where(valid, tl.load(inv_count_ptr).to(tl.float32), 0.0)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        x = tl.load(logits_row + cols, mask=cols < V, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - (cols == target).to(tl.float32)) * scale
        tl.store(grad_row + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < V)


def ce_chunk(logits_CV: Tensor, labels_C: Tensor, inv_count: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(summed CE of the chunk in fp32, d(mean loss)/d logits in the logits' dtype); `inv_count`: 0-d fp32."""
    assert logits_CV.is_contiguous() and logits_CV.dtype in (torch.bfloat16, torch.float16), logits_CV.dtype
    C, V = logits_CV.shape
    grad_CV = torch.empty_like(logits_CV)
    loss_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    if C:
        _ce_kernel[(C,)](logits_CV, labels_C.contiguous(), inv_count, grad_CV, loss_C, V, IGNORE=ignore_index,
                         BLOCK_V=BLOCK_V, num_warps=WARPS)
    return loss_C.sum(), grad_CV
