"""The router input's prefix centring (routing.input_centring=prefix) for the triton routing backend: the
scan of sonic/routing/scores.py's prefix_centre and prefix_centre_backward, which define the semantics.

Both are two passes over (sequence, chunk of BS positions, block of BD features) tiles, all in parallel:
  1. per tile, the sum over its positions (fp32), then a scan over the chunks of each sequence (a tiny
     torch cumsum over B x chunks x D) gives each tile the sum over the earlier (or later) chunks;
  2. per tile, a cumsum over its positions plus that carry: the forward writes c in x's dtype and each
     row's sum of c^2 over its BD features (summed over the blocks in a fixed order: deterministic, no
     atomics); the backward writes dx from the gradient on c.
The forward reads x twice and writes c; the backward reads (dc, c) twice and writes dx. Nothing depends on
the routing, and the launch configuration is fixed: no autotuning.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonic.routing import scores

BS, BD = 64, 64  # positions x features per tile: 128-byte rows of bf16


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer a kernel writes is allocated here (tests poison it to catch unwritten output)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _tile(ptr, seq, chunk, dblk, S, D, BS: tl.constexpr, BD: tl.constexpr):
    """Offsets and mask of one (sequence, chunk, feature block) tile of a (B*S, D) row-major tensor, and its
    positions within the sequence."""
    s = chunk * BS + tl.arange(0, BS)
    d = dblk * BD + tl.arange(0, BD)
    mask = (s < S)[:, None] & (d < D)[None, :]
    rows = seq.to(tl.int64) * S + s
    return ptr + rows[:, None] * D + d[None, :], mask, s, rows


@triton.jit
def _gradient(dc_ptr, c_ptr, alpha_ptr, seq, chunk, dblk, S, D, BS: tl.constexpr, BD: tl.constexpr):
    """The tile's total gradient on c, g = dc + alpha * c, divided by each position's count (g_t / t)."""
    dc, mask, s, rows = _tile(dc_ptr, seq, chunk, dblk, S, D, BS, BD)
    c, _, _, _ = _tile(c_ptr, seq, chunk, dblk, S, D, BS, BD)
    alpha = tl.load(alpha_ptr + rows, mask=s < S, other=0.0)
    g = tl.load(dc, mask=mask, other=0.0).to(tl.float32) + alpha[:, None] * tl.load(c, mask=mask, other=0.0).to(
        tl.float32)
    return g, g / tl.maximum(s, 1).to(tl.float32)[:, None], mask


@triton.jit
def _chunk_sums_kernel(x_ptr, sums_ptr, S, D, NC, BS: tl.constexpr, BD: tl.constexpr):
    """sums[seq, chunk, d] = sum of x over the chunk's positions."""
    seq, chunk, dblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ptrs, mask, _, _ = _tile(x_ptr, seq, chunk, dblk, S, D, BS, BD)
    d = dblk * BD + tl.arange(0, BD)
    total = tl.sum(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), axis=0)
    tl.store(sums_ptr + (seq.to(tl.int64) * NC + chunk) * D + d, total, mask=d < D)


@triton.jit
def _centre_kernel(x_ptr, earlier_ptr, c_ptr, sumsq_ptr, S, D, NC, ND, BS: tl.constexpr, BD: tl.constexpr):
    """c = x - (earlier chunks' sum + this chunk's sum before the position) / count, and sum over the block of
    c^2 (of c rounded to its dtype) per row."""
    seq, chunk, dblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ptrs, mask, s, rows = _tile(x_ptr, seq, chunk, dblk, S, D, BS, BD)
    d = dblk * BD + tl.arange(0, BD)
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    carry = tl.load(earlier_ptr + (seq.to(tl.int64) * NC + chunk) * D + d, mask=d < D, other=0.0)
    earlier = tl.cumsum(x, axis=0) - x + carry[None, :]
    c = (x - earlier / tl.maximum(s, 1).to(tl.float32)[:, None]).to(c_ptr.dtype.element_ty)
    c_ptrs, _, _, _ = _tile(c_ptr, seq, chunk, dblk, S, D, BS, BD)
    tl.store(c_ptrs, c, mask=mask)
    cf = c.to(tl.float32)
    tl.store(sumsq_ptr + rows * ND + dblk, tl.sum(cf * cf, axis=1), mask=s < S)


@triton.jit
def _grad_chunk_sums_kernel(dc_ptr, c_ptr, alpha_ptr, sums_ptr, S, D, NC, BS: tl.constexpr, BD: tl.constexpr):
    """sums[seq, chunk, d] = sum over the chunk's positions t of g_t / t."""
    seq, chunk, dblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, u, _ = _gradient(dc_ptr, c_ptr, alpha_ptr, seq, chunk, dblk, S, D, BS, BD)
    d = dblk * BD + tl.arange(0, BD)
    tl.store(sums_ptr + (seq.to(tl.int64) * NC + chunk) * D + d, tl.sum(u, axis=0), mask=d < D)


@triton.jit
def _centre_backward_kernel(dc_ptr, c_ptr, alpha_ptr, later_ptr, dx_ptr, S, D, NC, BS: tl.constexpr,
                            BD: tl.constexpr):
    """dx_s = g_s - sum_{t > s} g_t / t: the later chunks' sum plus this chunk's after the position."""
    seq, chunk, dblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, u, mask = _gradient(dc_ptr, c_ptr, alpha_ptr, seq, chunk, dblk, S, D, BS, BD)
    d = dblk * BD + tl.arange(0, BD)
    carry = tl.load(later_ptr + (seq.to(tl.int64) * NC + chunk) * D + d, mask=d < D, other=0.0)
    later = tl.sum(u, axis=0)[None, :] - tl.cumsum(u, axis=0) + carry[None, :]
    dx_ptrs, _, _, _ = _tile(dx_ptr, seq, chunk, dblk, S, D, BS, BD)
    tl.store(dx_ptrs, (g - later).to(dx_ptr.dtype.element_ty), mask=mask)


def _grid(T: int, D: int, S: int) -> tuple[int, int, int]:
    return T // S, triton.cdiv(S, BS), triton.cdiv(D, BD)


@torch.library.custom_op("sonic::prefix_centre", mutates_args=())
def _prefix_centre(x_TD: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    T, D = x_TD.shape
    grid = _grid(T, D, seq_len)
    sums_BCD = _alloc(grid[:2] + (D,), torch.float32, x_TD.device)
    c_TD = _alloc((T, D), x_TD.dtype, x_TD.device)
    sumsq_TN = _alloc((T, grid[2]), torch.float32, x_TD.device)
    if T:
        _chunk_sums_kernel[grid](x_TD, sums_BCD, seq_len, D, grid[1], BS=BS, BD=BD, num_warps=4)
        earlier_BCD = sums_BCD.cumsum(1) - sums_BCD
        _centre_kernel[grid](x_TD, earlier_BCD, c_TD, sumsq_TN, seq_len, D, grid[1], grid[2], BS=BS, BD=BD,
                             num_warps=4)
    return c_TD, sumsq_TN.sum(1) / D  # a fixed-order sum over the feature blocks: deterministic


@_prefix_centre.register_fake
def _(x_TD, seq_len):
    return torch.empty_like(x_TD), x_TD.new_empty((x_TD.shape[0],), dtype=torch.float32)


@torch.library.custom_op("sonic::prefix_centre_backward", mutates_args=())
def _prefix_centre_backward(dc_TD: Tensor, c_TD: Tensor, alpha_T: Tensor, seq_len: int) -> Tensor:
    T, D = dc_TD.shape
    grid = _grid(T, D, seq_len)
    sums_BCD = _alloc(grid[:2] + (D,), torch.float32, dc_TD.device)
    dx_TD = _alloc((T, D), dc_TD.dtype, dc_TD.device)
    if T:
        _grad_chunk_sums_kernel[grid](dc_TD, c_TD, alpha_T, sums_BCD, seq_len, D, grid[1], BS=BS, BD=BD, num_warps=4)
        later_BCD = sums_BCD.flip(1).cumsum(1).flip(1) - sums_BCD
        _centre_backward_kernel[grid](dc_TD, c_TD, alpha_T, later_BCD, dx_TD, seq_len, D, grid[1], BS=BS, BD=BD,
                                      num_warps=4)
    return dx_TD


@_prefix_centre_backward.register_fake
def _(dc_TD, c_TD, alpha_T, seq_len):
    return torch.empty_like(dc_TD)


def _fused(x_TD: Tensor) -> bool:
    """fp64 keeps the definition's fp64 sums (the kernels sum in fp32)."""
    return x_TD.dtype != torch.float64


def prefix_centre(x_TD: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """sonic.routing.scores.prefix_centre, fused (see the module docstring)."""
    if not _fused(x_TD):
        return scores.prefix_centre(x_TD, seq_len)
    return _prefix_centre(x_TD.contiguous(), seq_len)


def prefix_centre_backward(dc_TD: Tensor, c_TD: Tensor, alpha_T: Tensor, seq_len: int) -> Tensor:
    """sonic.routing.scores.prefix_centre_backward, fused."""
    if not _fused(dc_TD):
        return scores.prefix_centre_backward(dc_TD, c_TD, alpha_T, seq_len)
    return _prefix_centre_backward(dc_TD.contiguous(), c_TD.contiguous(), alpha_T.float().contiguous(), seq_len)
