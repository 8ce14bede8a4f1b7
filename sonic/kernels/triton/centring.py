"""The router's prefix-centred logits (routing.input_centring=prefix) for the triton routing backend:
sonic/routing/scores.py's prefix_centred_logits[_backward], which define the semantics, fused so that the
centred input c never reaches memory.

c_t = x_t - M_t / n_t, with M_t the sum of the sequence's positions before t and n_t = max(t, 1), rounded to x's
dtype; logits_t = (W c_t) * rstd_t, rstd_t = rsqrt(mean(c_t^2) + EPS).

The forward splits by linearity: W c_t = z_t - (sum of z_s over s < t) / n_t with z = W x, so the prefix is
taken over the T x E logits, not over the T x D input; only rstd needs c itself.
  forward   _walk_kernel: one program per (sequence, block of BD features) walks the sequence's chunks of BS
            positions in order, carrying the sum of the earlier ones; per chunk it writes that carry (the earlier
            chunks' sum of x) and each position's sum of c^2 over its features, c rounded to x's dtype as the
            definition's. The sum over a chunk's earlier positions is a product with a 0/1 triangular matrix on
            tensor cores (exact products, fp32 sums; tl.cumsum along the rows crossed warps and cost more).
            z = W x and the earlier chunks' W-sums are two GEMMs (cuBLAS, fp32 out), then _logits_kernel takes
            each chunk's prefix of z and the rstd. x is read once by the walk and once by the GEMM.
            (The kernel before it computed W c per chunk tile: every tile read all of W, and it spilled registers;
            its times are in bench/results/2026-11-25-h200-centring-stages.json.)
  backward  rstd is a constant to autograd (sonic/routing/scores.py says why), so with dz = dlogits * rstd the
            gradient is linear in dz: dx = P^T W^T dz = (P^T dz) W and dW = (P^T dz)^T x, where
            (P^T g)_s = g_s - sum_{t>s} g_t / n_t. q = P^T dz is T x E: the chunk sums of dz / n, a reverse scan,
            then q per chunk; dx and dW are two GEMMs (cuBLAS).
Sums are fp32 in a fixed order (no atomics): deterministic. The launch configuration depends only on the number of
sequences, D and E: no autotuning. Where the time goes by kernel: `python -m bench.centring --profile`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonic.routing import scores

BC = 32  # chunks per step of the scan


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer a kernel writes is allocated here (tests poison it to catch unwritten output)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _tiles(E: int) -> dict:
    """The backward's tiles: positions per tile (BS) and the experts' block (BE), whose (BS, BE) fp32 tile stays at
    8192 values."""
    be = max(16, triton.next_power_of_2(E))
    return dict(BS=max(16, min(64, 8192 // be)), BE=be, num_warps=4 if be <= 128 else 8)


def _forward_tiles(B: int, D: int) -> dict:
    """The forward's chunk of positions (BS) and the walk's feature block (BD). The walk has B * D / BD programs,
    each one chunk's load in flight while it computes the last; at BD = 32 (109 registers at 4 warps for sm_90)
    an SM holds four. Narrower blocks where that would give fewer than two programs per SM of an H200 (132)."""
    return dict(BS=64, BD=32 if B * D >= 2 * 132 * 32 else 16, num_warps=4)


@triton.jit
def _positions(seq, chunk, S, BS: tl.constexpr):
    """The tile's positions within the sequence, their rows of the (B*S, .) tensors, and n = max(s, 1)."""
    s = chunk * BS + tl.arange(0, BS)
    return s, seq.to(tl.int64) * S + s, s < S, tl.maximum(s, 1).to(tl.float32)


@triton.jit
def _dot_exact(a, b):
    """a @ b in fp32 for a b in x's dtype: fp32 inputs exactly, 16-bit ones on tensor cores."""
    if b.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def _load_chunk(x_ptr, seq, chunk, S, D, d, dm, BS: tl.constexpr):
    """x of one chunk's positions (zeros past the sequence's end) and the block's features."""
    _, rows, sm, _ = _positions(seq, chunk, S, BS)
    return tl.load(x_ptr + rows[:, None] * D + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)


@triton.jit
def _walk_kernel(x_ptr, earlier_ptr, sq_ptr, S, D, NC, NDB, BS: tl.constexpr, BD: tl.constexpr):
    """For one (sequence, feature block), chunk by chunk in order: earlier[seq, chunk, d] = the sum of x over the
    earlier chunks, and sq[t, block] = the sum over the block's features of c_t^2 (c rounded to x's dtype)."""
    seq, dblk = tl.program_id(0), tl.program_id(1)
    d = dblk * BD + tl.arange(0, BD)
    dm = d < D
    i = tl.arange(0, BS)
    earlier_pos = (i[None, :] < i[:, None]).to(tl.float32)  # row t sums the tile's positions before t
    carry = tl.zeros((BD,), tl.float32)
    x_next = _load_chunk(x_ptr, seq, 0, S, D, d, dm, BS)
    for chunk in range(0, NC):
        _, rows, sm, n = _positions(seq, chunk, S, BS)
        x = x_next
        x_next = _load_chunk(x_ptr, seq, chunk + 1, S, D, d, dm, BS)  # in flight while this chunk computes
        tl.store(earlier_ptr + (seq.to(tl.int64) * NC + chunk) * D + d, carry, mask=dm)
        c = x.to(tl.float32) - (carry[None, :] + _dot_exact(earlier_pos, x)) / n[:, None]
        c = c.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(sq_ptr + rows * NDB + dblk, tl.sum(c * c, axis=1), mask=sm)
        carry += tl.sum(x.to(tl.float32), axis=0)


@triton.jit
def _logits_kernel(z_ptr, earlier_z_ptr, sq_ptr, logits_ptr, rstd_ptr, S, D, NC, NDB, E: tl.constexpr,
                   EPS: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr):
    """logits = (z - (the earlier chunks' sum of z + the tile's earlier positions') / n) * rstd for one (sequence,
    chunk, block of experts), rstd from the walk's sums of c^2."""
    seq, chunk, eblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, rows, sm, n = _positions(seq, chunk, S, BS)
    e = eblk * BE + tl.arange(0, BE)
    em = e < E
    m = sm[:, None] & em[None, :]
    z = tl.load(z_ptr + rows[:, None] * E + e[None, :], mask=m, other=0.0)
    earlier = tl.load(earlier_z_ptr + (seq.to(tl.int64) * NC + chunk) * E + e, mask=em, other=0.0)
    p = tl.arange(0, BP)
    sq = tl.load(sq_ptr + rows[:, None] * NDB + p[None, :], mask=sm[:, None] & (p < NDB)[None, :], other=0.0)
    rstd = tl.rsqrt(tl.sum(sq, axis=1) / D + EPS)
    logits = (z - (earlier[None, :] + tl.cumsum(z, axis=0) - z) / n[:, None]) * rstd[:, None]
    tl.store(logits_ptr + rows[:, None] * E + e[None, :], logits, mask=m)
    if eblk == 0:
        tl.store(rstd_ptr + rows, rstd, mask=sm)


@triton.jit
def _scan_kernel(sums_ptr, out_ptr, NC, F, REVERSE: tl.constexpr, BC: tl.constexpr, BF: tl.constexpr):
    """out[seq, c] = the sum of sums[seq, c'] over the chunks c' before c (after c with REVERSE)."""
    seq, fblk = tl.program_id(0), tl.program_id(1)
    f = fblk * BF + tl.arange(0, BF)
    fm = f < F
    carry = tl.zeros((BF,), tl.float32)
    for c0 in range(0, NC, BC):
        c = c0 + tl.arange(0, BC)
        if REVERSE:
            c = NC - 1 - c  # the later chunks first
        m = ((c >= 0) & (c < NC))[:, None] & fm[None, :]
        ptrs = (seq.to(tl.int64) * NC + c)[:, None] * F + f[None, :]
        v = tl.load(sums_ptr + ptrs, mask=m, other=0.0)
        tl.store(out_ptr + ptrs, carry[None, :] + tl.cumsum(v, axis=0) - v, mask=m)
        carry += tl.sum(v, axis=0)


@triton.jit
def _dz(dlogits_ptr, rstd_ptr, rows, sm, E: tl.constexpr, BE: tl.constexpr):
    """dz = dlogits * rstd of the tile's positions, its experts and the (positions, experts) mask."""
    e = tl.arange(0, BE)
    m = sm[:, None] & (e < E)[None, :]
    dl = tl.load(dlogits_ptr + rows[:, None] * E + e[None, :], mask=m, other=0.0)
    return dl * tl.load(rstd_ptr + rows, mask=sm, other=1.0)[:, None], e, m


@triton.jit
def _dz_sums_kernel(dlogits_ptr, rstd_ptr, sums_e_ptr, S, NC, E: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr):
    """Per chunk, the sum of dz / n over its positions."""
    seq, chunk = tl.program_id(0), tl.program_id(1)
    _, rows, sm, n = _positions(seq, chunk, S, BS)
    dz, e, _ = _dz(dlogits_ptr, rstd_ptr, rows, sm, E, BE)
    tl.store(sums_e_ptr + (seq.to(tl.int64) * NC + chunk) * E + e, tl.sum(dz / n[:, None], axis=0), mask=e < E)


@triton.jit
def _q_kernel(dlogits_ptr, rstd_ptr, later_e_ptr, q_ptr, S, NC, E: tl.constexpr, BS: tl.constexpr,
              BE: tl.constexpr):
    """q = P^T dz: dz_s - sum_{t>s} dz_t / n_t, the later chunks' sum plus this chunk's after the position."""
    seq, chunk = tl.program_id(0), tl.program_id(1)
    _, rows, sm, n = _positions(seq, chunk, S, BS)
    dz, e, m = _dz(dlogits_ptr, rstd_ptr, rows, sm, E, BE)
    u = dz / n[:, None]
    later = tl.load(later_e_ptr + (seq.to(tl.int64) * NC + chunk) * E + e, mask=e < E, other=0.0)
    q = dz - (later[None, :] + tl.sum(u, axis=0)[None, :] - tl.cumsum(u, axis=0))
    tl.store(q_ptr + rows[:, None] * E + e[None, :], q.to(q_ptr.dtype.element_ty), mask=m)


def scan_chunks(sums: Tensor, reverse: bool) -> Tensor:
    """(B, chunks, F) per-chunk sums -> per chunk, the sum over the earlier chunks (the later ones with reverse)."""
    B, NC, F = sums.shape
    out = _alloc(sums.shape, torch.float32, sums.device)
    _scan_kernel[(B, triton.cdiv(F, 128))](sums, out, NC, F, REVERSE=reverse, BC=BC, BF=128, num_warps=4)
    return out


def _fused(x_TD: Tensor) -> bool:
    """fp64 keeps the definition's fp64 sums (the kernels sum in fp32)."""
    return x_TD.dtype != torch.float64


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b summed in fp32 with an fp32 result: 16-bit operands on tensor cores (exact products), fp32 ones in
    fp32 (cuBLAS rounds them to TF32 only where the user allowed it globally)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def prefix_centred_logits(x_TD: Tensor, weight_ED: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """sonic.routing.scores.prefix_centred_logits, fused (see the module docstring)."""
    if not _fused(x_TD):
        return scores.prefix_centred_logits(x_TD, weight_ED, seq_len)
    x_TD, w_ED = x_TD.contiguous(), weight_ED.to(x_TD.dtype).contiguous()
    (T, D), E, S = x_TD.shape, w_ED.shape[0], seq_len
    logits_TE = _alloc((T, E), torch.float32, x_TD.device)
    rstd_T = _alloc((T,), torch.float32, x_TD.device)
    if not T:
        return logits_TE, rstd_T
    cfg = _forward_tiles(T // S, D)
    B, NC, NDB = T // S, triton.cdiv(S, cfg["BS"]), triton.cdiv(D, cfg["BD"])
    earlier_x = _alloc((B, NC, D), torch.float32, x_TD.device)
    sq = _alloc((T, NDB), torch.float32, x_TD.device)
    _walk_kernel[(B, NDB)](x_TD, earlier_x, sq, S, D, NC, NDB, **cfg)
    # the same rounded W in both products, so that z's share from the earlier positions cancels
    z_TE = _mm_fp32(x_TD, w_ED.t())
    earlier_z = earlier_x.view(B * NC, D) @ w_ED.float().t()
    BE = min(128, max(16, triton.next_power_of_2(E)))
    _logits_kernel[(B, NC, triton.cdiv(E, BE))](z_TE, earlier_z, sq, logits_TE, rstd_T, S, D, NC, NDB, E=E,
                                                EPS=scores.EPS, BS=cfg["BS"], BE=BE,
                                                BP=max(16, triton.next_power_of_2(NDB)), num_warps=4)
    return logits_TE, rstd_T


def prefix_centred_logits_backward(dlogits_TE: Tensor, x_TD: Tensor, weight_ED: Tensor, rstd_T: Tensor,
                                   seq_len: int) -> tuple[Tensor, Tensor]:
    """sonic.routing.scores.prefix_centred_logits_backward, fused: q = P^T dz, dx = q W, dW = q^T x."""
    if not _fused(x_TD):
        return scores.prefix_centred_logits_backward(dlogits_TE, x_TD, weight_ED, rstd_T, seq_len)
    x_TD, w_ED = x_TD.contiguous(), weight_ED.to(x_TD.dtype).contiguous()
    dlogits_TE, rstd_T = dlogits_TE.float().contiguous(), rstd_T.float().contiguous()
    (T, D), E, S = x_TD.shape, w_ED.shape[0], seq_len
    if not T:
        return _alloc((T, D), x_TD.dtype, x_TD.device), torch.zeros_like(weight_ED)
    q_TE = _alloc((T, E), x_TD.dtype, x_TD.device)
    cfg = _tiles(E)
    BS, BE = cfg["BS"], cfg["BE"]
    B, NC = T // S, triton.cdiv(S, BS)
    sums_e = _alloc((B, NC, E), torch.float32, x_TD.device)
    _dz_sums_kernel[(B, NC)](dlogits_TE, rstd_T, sums_e, S, NC, E=E, BS=BS, BE=BE, num_warps=4)
    _q_kernel[(B, NC)](dlogits_TE, rstd_T, scan_chunks(sums_e, reverse=True), q_TE, S, NC, E=E, BS=BS, BE=BE,
                       num_warps=4)
    return q_TE @ w_ED, (q_TE.t() @ x_TD).to(weight_ED.dtype)
