"""The router's logit norm (routing.logit_norm=prefix) for the triton routing backend: sonic/routing/scores.py's
prefix_standardise[_backward], which define the semantics.

Legend: B sequences of S positions (T = B * S tokens), E experts; a chunk is STAT_CHUNK (L) positions.

  forward   per chunk, the sums of z and z^2 over it (_norm_sums_kernel), then the scan over the chunks (centring.py
            scan_chunks): the stats, the sums over each chunk's earlier positions, which the op keeps. Then per
            chunk, y from the stats plus the sums over the chunk's own earlier positions (a cumsum along the tile).
  backward  per chunk, one position at a time from its stats: rstd, dz = dy * rstd, then z = y / rstd + mu joins
            the sums (scores.py says why the recovered scale is the forward's to a few ulps). The loop is
            unrolled, so the loads of every position issue without waiting on the recurrence.
Sums are fp32 in a fixed order (no atomics): deterministic. One program per (sequence, chunk, block of 128
experts), 4 warps: the launch depends only on E, with nothing to tune.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonic.kernels.triton import launch
from sonic.kernels.triton.centring import runs_fused, scan_chunks
from sonic.routing import scores

L = scores.STAT_CHUNK
UNROLL = 8


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer a kernel writes is allocated here (tests poison it to catch unwritten output)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _block(E: int) -> int:
    return max(16, min(128, triton.next_power_of_2(E)))


@triton.jit
def _chunk(seq, chunk, eblk, S, E: tl.constexpr, L: tl.constexpr, BE: tl.constexpr):
    """The chunk's positions within the sequence, their rows of the (B*S, E) tensors, the block's experts and
    the (positions, experts) mask."""
    s = chunk * L + tl.arange(0, L)
    e = eblk * BE + tl.arange(0, BE)
    em = e < E
    return s, seq.to(tl.int64) * S + s, e, em, (s < S)[:, None] & em[None, :]


@triton.jit
def _norm_sums_kernel(z_ptr, sums_ptr, S, NC, E: tl.constexpr, L: tl.constexpr, BE: tl.constexpr):
    """sums[seq, chunk] = (sum of z, sum of z^2) over the chunk's positions."""
    seq, chunk, eblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, rows, e, em, m = _chunk(seq, chunk, eblk, S, E, L, BE)
    z = tl.load(z_ptr + rows[:, None] * E + e[None, :], mask=m, other=0.0).to(tl.float32)
    base = (seq.to(tl.int64) * NC + chunk) * 2 * E
    tl.store(sums_ptr + base + e, tl.sum(z, axis=0), mask=em)
    tl.store(sums_ptr + base + E + e, tl.sum(z * z, axis=0), mask=em)


@triton.jit
def _moments(earlier, earlier_sq, s, PRIOR: tl.constexpr):
    """(mu, rstd) at positions s (broadcast against the sums), as scores._moments."""
    n = s.to(tl.float32) + PRIOR
    mean = earlier / n
    return mean, tl.rsqrt(tl.maximum((earlier_sq + PRIOR) / n - mean * mean, 1e-4))


@triton.jit
def _norm_forward_kernel(z_ptr, stats_ptr, y_ptr, S, NC, E: tl.constexpr, L: tl.constexpr, BE: tl.constexpr,
                         PRIOR: tl.constexpr):
    seq, chunk, eblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s, rows, e, em, m = _chunk(seq, chunk, eblk, S, E, L, BE)
    z = tl.load(z_ptr + rows[:, None] * E + e[None, :], mask=m, other=0.0).to(tl.float32)
    base = (seq.to(tl.int64) * NC + chunk) * 2 * E
    zz = z * z
    earlier = tl.load(stats_ptr + base + e, mask=em, other=0.0)[None, :] + tl.cumsum(z, axis=0) - z
    earlier_sq = tl.load(stats_ptr + base + E + e, mask=em, other=0.0)[None, :] + tl.cumsum(zz, axis=0) - zz
    mean, rstd = _moments(earlier, earlier_sq, s[:, None], PRIOR)
    tl.store(y_ptr + rows[:, None] * E + e[None, :], (z - mean) * rstd, mask=m)


@triton.jit
def _norm_backward_kernel(dy_ptr, y_ptr, stats_ptr, dz_ptr, S, NC, E: tl.constexpr, L: tl.constexpr, BE: tl.constexpr,
                          PRIOR: tl.constexpr, UNROLL: tl.constexpr):
    seq, chunk, eblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = eblk * BE + tl.arange(0, BE)
    em = e < E
    base = (seq.to(tl.int64) * NC + chunk) * 2 * E
    earlier = tl.load(stats_ptr + base + e, mask=em, other=0.0)
    earlier_sq = tl.load(stats_ptr + base + E + e, mask=em, other=0.0)
    for j0 in range(0, L, UNROLL):  # unrolled by UNROLL: its loads issue together; all of L compiled for 44 s
        for j in tl.static_range(UNROLL):
            s = chunk * L + j0 + j
            m = em & (e * 0 + s < S)  # the position broadcast over the block (a scalar mask is not portable)
            at = (seq.to(tl.int64) * S + s) * E + e
            y = tl.load(y_ptr + at, mask=m, other=0.0)
            mean, rstd = _moments(earlier, earlier_sq, s, PRIOR)
            tl.store(dz_ptr + at, tl.load(dy_ptr + at, mask=m, other=0.0) * rstd, mask=m)
            z = y / rstd + mean
            earlier += z
            earlier_sq += z * z


def prefix_standardise(logits_TE: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """sonic.routing.scores.prefix_standardise, fused (see the module docstring)."""
    if not runs_fused(logits_TE):
        return scores.prefix_standardise(logits_TE, seq_len)
    z_TE = logits_TE.contiguous()
    (T, E), S = z_TE.shape, seq_len
    B, NC, BE = T // S, triton.cdiv(S, L), _block(E)
    y_TE = _alloc((T, E), torch.float32, z_TE.device)
    if not T:
        return y_TE, _alloc((B, NC, 2, E), torch.float32, z_TE.device)
    grid = (B, NC, triton.cdiv(E, BE))
    sums = _alloc((B, NC, 2 * E), torch.float32, z_TE.device)
    launch(_norm_sums_kernel, grid)(z_TE, sums, S, NC, E=E, L=L, BE=BE, num_warps=4)
    stats = scan_chunks(sums, reverse=False).view(B, NC, 2, E)
    launch(_norm_forward_kernel, grid)(z_TE, stats, y_TE, S, NC, E=E, L=L, BE=BE, PRIOR=scores.PRIOR_POSITIONS,
                                       num_warps=4)
    return y_TE, stats


def prefix_standardise_backward(dy_TE: Tensor, y_TE: Tensor, stats: Tensor, seq_len: int) -> Tensor:
    """sonic.routing.scores.prefix_standardise_backward, fused: dz = dy * rstd, rstd recovered from y and stats."""
    if not runs_fused(y_TE):
        return scores.prefix_standardise_backward(dy_TE, y_TE, stats, seq_len)
    dy_TE, y_TE, stats = dy_TE.float().contiguous(), y_TE.contiguous(), stats.contiguous()
    (T, E), S = y_TE.shape, seq_len
    dz_TE = _alloc((T, E), torch.float32, y_TE.device)
    if T:
        BE = _block(E)
        launch(_norm_backward_kernel, (T // S, triton.cdiv(S, L), triton.cdiv(E, BE)))(
            dy_TE, y_TE, stats, dz_TE, S, stats.shape[1], E=E, L=L, BE=BE, PRIOR=scores.PRIOR_POSITIONS,
            UNROLL=UNROLL, num_warps=4)
    return dz_TE
