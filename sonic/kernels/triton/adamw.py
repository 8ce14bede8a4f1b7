"""AdamW's update of one parameter tensor in one pass (optim.implementation=triton, `sonic.train.optim.TritonAdamW`).

Per element it reads the parameter, its gradient and the two moments once, and writes the parameter and the
moments once: 28 bytes per fp32 parameter, against torch's fused AdamW's 28 bytes plus, when the gradients are
clipped, a read and a write of every gradient (torch's clip scales them in place before the step, and its fused
kernel, given the clip as `grad_scale`, writes the scaled gradient back). Here the clip is a divisor the kernel
applies as it reads the gradient, and nothing is written back to the gradient.

The arithmetic is torch's AdamW (torch/optim/adamw.py, fused and foreach agree to rounding):
  p <- p - lr * wd * p;  m <- m + (1 - b1) (g - m);  v <- b2 v + (1 - b2) g^2
  p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
with t the step count after this step, read from the device (skipped steps do not advance it), and the bias
corrections in fp32 (torch's fused kernel takes them in fp64: the updates agree to ~1e-7 relative).
`found_inf` != 0 leaves everything untouched, as in torch's fused kernel.

With `master` (an fp32 copy of a bf16 parameter, `TritonAdamW(compute_dtype=...)`), the arithmetic runs on the
master, and the parameter is written as the master rounded to its dtype. With a bf16 gradient that is 28 bytes
per weight as before, and the 12 bytes of casting each fp32 weight for the forward and its gradient back after
the backward are gone.

With bf16 moments (`TritonAdamW(moment_dtype=torch.bfloat16)`, optim.moment_dtype) the moments are read and
written as bf16, 8 bytes per weight fewer, and computed in fp32 as above. They are stored with stochastic
rounding: round to nearest would lose every update smaller than half a bf16 step of the moment (v <- b2 v +
(1 - b2) g^2 then stalls once (1 - b2) g^2 / v falls under 2^-9), stochastic rounding keeps each update in
expectation. The random bits come from the step count and the parameter's `salt`, so a resumed run draws the
same ones.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 2048  # elements per program: a streaming kernel, 8 warps, four 16-byte loads per stream per thread
WARPS = 8


@triton.jit
def _stochastic_bf16(x, bits):
    """fp32 x rounded to bf16 up or down, up with probability the dropped fraction (bits: 32 random bits)."""
    u = x.to(tl.uint32, bitcast=True)
    up = ((u + (bits & 0xFFFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)  # exact in bf16: the cast keeps it
    return tl.where(x == x, up, x).to(tl.bfloat16)  # NaN stays NaN (its carry could reach the sign)


@triton.jit
def _adamw_kernel(p_ptr, master_ptr, g_ptr, m_ptr, v_ptr, step_ptr, scale_ptr, skip_ptr, n,
                  lr, weight_decay, beta1, beta2, log2_beta1, log2_beta2, eps, salt,
                  HAS_MASTER: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SKIP: tl.constexpr,
                  BF16_MOMENTS: tl.constexpr, BLOCK: tl.constexpr):
    if HAS_SKIP:
        if tl.load(skip_ptr) != 0:
            return
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    t = tl.load(step_ptr).to(tl.float32)
    bias1 = 1.0 - tl.exp2(t * log2_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(t * log2_beta2))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr).to(tl.float32)
    if HAS_MASTER:
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    else:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p - lr * weight_decay * p
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    if HAS_MASTER:
        tl.store(master_ptr + offs, p, mask=mask)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    if BF16_MOMENTS:
        r_m, r_v, _, _ = tl.randint4x(tl.load(step_ptr).to(tl.int64) * 65537 + salt, offs)
        tl.store(m_ptr + offs, _stochastic_bf16(m, r_m), mask=mask)
        tl.store(v_ptr + offs, _stochastic_bf16(v, r_v), mask=mask)
    else:
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else float("-inf")  # beta = 0: no bias correction (exp2(-inf) = 0)


def adamw_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, *, lr: float,
           weight_decay: float, beta1: float, beta2: float, eps: float, grad_scale: Tensor | None = None,
           found_inf: Tensor | None = None, master: Tensor | None = None, salt: int = 0) -> None:
    """One AdamW step of `param` in place (and of its moments). `step`: this parameter's step count after
    this step, a 0-d tensor on its device; `grad_scale`: a 0-d divisor of the gradient (the clip);
    `found_inf`: a 0-d flag, nonzero to leave everything as it is; `master`: param's fp32 master copy, which
    takes the step (param gets it rounded). bf16 moments are stored with stochastic rounding, seeded by the
    step and `salt` (a number of this parameter's own)."""
    tensors = (param, grad, exp_avg, exp_avg_sq) + (() if master is None else (master,))
    assert all(t.is_contiguous() and t.shape == param.shape for t in tensors) and step.numel() == 1
    assert master is None or master.dtype == torch.float32
    bf16_moments = exp_avg.dtype == torch.bfloat16
    assert exp_avg_sq.dtype == exp_avg.dtype and (bf16_moments or exp_avg.dtype == torch.float32), exp_avg.dtype
    n = param.numel()
    if n == 0:
        return
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param, master if master is not None else param, grad, exp_avg, exp_avg_sq, step,
        grad_scale if grad_scale is not None else step, found_inf if found_inf is not None else step, n, lr,
        weight_decay, beta1, beta2, _log2(beta1), _log2(beta2), eps, salt, HAS_MASTER=master is not None,
        HAS_SCALE=grad_scale is not None, HAS_SKIP=found_inf is not None, BF16_MOMENTS=bf16_moments, BLOCK=BLOCK,
        num_warps=WARPS)
