"""The router's prefix-centred logits (routing.input_centring=prefix) for the triton routing backend:
sonic/routing/scores.py's prefix_centred_logits[_backward], which define the semantics, fused so that the
centred input c never reaches memory.

c_t = x_t - M_t / n_t, with M_t the sum of the sequence's positions before t and n_t = max(t, 1), rounded to x's
dtype; logits_t = (W c_t) * rstd_t, rstd_t = rsqrt(mean(c_t^2) + EPS).

The forward has two ways; a tile is (sequence, chunk of BS positions) x (block of BD features) or (block of
experts), and the chunks are independent, so every kernel's programs run in parallel. Both start from the chunk
sums of x and their scan: each chunk's earlier sum, the carry (B x chunks x D, fp32), whose mean over its positions
a small kernel splits into two 16-bit parts (hi + lo: exact to 2^-17) with |carry|^2, and cuBLAS multiplies by W
(W carry, exact products summed in fp32). Per chunk, one kernel (_gram_kernel) then sums products of x alone over the
feature blocks: the Gram matrix x x^T and x against the carry's parts, from which |c|^2 and so rstd follow by
expanding c = x - M / n (its docstring has the algebra), c itself never formed. Every product is on tensor cores
from exact 16-bit inputs; the shared part of x cancels in fp32, so the result is c unrounded, closer to the fp64
definition than the definition's own bf16 evaluation of W c.
  E <= 128  (TILE_MAX_E) the same kernel also sums z = x W^T and forms the logits:
            W c_t = z_t - (W carry + the chunk's earlier z) / n_t. Every chunk reads all of W, so W's traffic is
            E / BS times x's, and the (BS, E) accumulator caps BS.
  above     z = W x is a cuBLAS GEMM with an fp32 result, in the same rounded W as W carry so that the earlier
            positions' share cancels; then per chunk and block of experts, the logits (_logits_kernel). More
            launches, which cost more than the kernel's W traffic at small E. (A sequential walk over the chunks
            instead of the sums and scan was latency-bound: bench/results/2026-11-25-h200-centring-linearity-ab.json.)
  Centring each feature block first (c = x minus a lower-triangular dot, rounded, then W c) was 1.24x slower at
  30B's shape, 1.13x at sonic_7b's and 0.91x at E 64 (bench/results/2026-11-26-h200-centring-gram-ab.json).
  backward  rstd is a constant to autograd (sonic/routing/scores.py says why), so with dz = dlogits * rstd the
            gradient is linear in dz: dx = P^T W^T dz = (P^T dz) W and dW = (P^T dz)^T x, where
            (P^T g)_s = g_s - sum_{t>s} g_t / n_t. q = P^T dz is T x E: the chunk sums of dz / n, a reverse scan,
            then q per chunk; dx and dW are two GEMMs (cuBLAS).
x is read twice forward up to E = 128 (sums, Gram), three times above (sums, Gram, GEMM), and twice backward (by
the GEMMs). Sums are fp32 in a fixed order (no atomics): deterministic. The forward's tiles are fixed
(`_forward_tiles`), the backward's depend only on E (`_tiles`): no autotuning. Where the time goes by kernel:
`python -m bench.centring --profile`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonic.kernels.triton import launch
from sonic.routing import scores

BC = 32  # chunks per step of the scan
# the forward's two ways (module docstring): W c per chunk up to this many experts, by cuBLAS above (on an H200 the
# per-chunk W c was as fast at 30B's shape and faster at sonic_7b's, 3x slower at E 512:
# bench/results/2026-11-25-h200-centring-v2-ab.json)
TILE_MAX_E = 128


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer a kernel writes is allocated here (tests poison it to catch unwritten output)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _tiles(E: int) -> dict:
    """The backward's tiles: positions per tile (BS) and the experts' block (BE), whose (BS, BE) fp32 tile stays at
    8192 values."""
    be = max(16, triton.next_power_of_2(E))
    return dict(BS=max(16, min(64, 8192 // be)), BE=be, num_warps=4 if be <= 128 else 8)


def _forward_tiles(E: int) -> dict:
    """The forward's chunk of positions (BS) and block of features (BD) for the sums and the Gram kernel, the same at
    every E: 64 positions on 4 warps halve the Gram matrix's products against 128 on 8, and with the loop's dots
    pipelined that won at every shape measured on an H200 (the Gram kernel 24-111 us against 32-144 at sonic_7b's
    to 30B's, bench/results/2026-11-26-h200-centring-profile-bs64.json beside ...-centring-gram-pipelined-ab.json).
    The logits' block of experts is at most 128 wide."""
    return dict(BS=64, BD=64, num_warps=4)


@triton.jit
def _positions(seq, chunk, S, BS: tl.constexpr):
    """The tile's positions within the sequence, their rows of the (B*S, .) tensors, and n = max(s, 1)."""
    s = chunk * BS + tl.arange(0, BS)
    return s, seq.to(tl.int64) * S + s, s < S, tl.maximum(s, 1).to(tl.float32)


@triton.jit
def _load_x(x_ptr, rows, sm, d0, D, BD: tl.constexpr):
    """x of the tile's positions in the features d0 .. d0 + BD (zeros outside x)."""
    d = d0 + tl.arange(0, BD)
    return tl.load(x_ptr + rows[:, None] * D + d[None, :], mask=sm[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _chunk_sums_kernel(x_ptr, sums_ptr, S, D, NC, BS: tl.constexpr, BD: tl.constexpr):
    """sums[seq, chunk, d] = sum of x over the chunk's positions."""
    seq, chunk, dblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, rows, sm, _ = _positions(seq, chunk, S, BS)
    d = dblk * BD + tl.arange(0, BD)
    x = tl.load(x_ptr + rows[:, None] * D + d[None, :], mask=sm[:, None] & (d < D)[None, :], other=0.0)
    tl.store(sums_ptr + (seq.to(tl.int64) * NC + chunk) * D + d, tl.sum(x.to(tl.float32), axis=0), mask=d < D)


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
def _centred_logits(z, earlier_z, n, rstd):
    """(z - (the earlier chunks' sum of z + the tile's earlier positions') / n) * rstd: W c by linearity, scaled."""
    return (z - (earlier_z[None, :] + tl.cumsum(z, axis=0) - z) / n[:, None]) * rstd[:, None]


@triton.jit
def _carry_parts_kernel(earlier_ptr, parts_ptr, carry_sq_ptr, NC, D, BS: tl.constexpr, BD: tl.constexpr):
    """Per (sequence, chunk) row: the carry's mean (carry / its count of positions) as two 16-bit parts, hi + lo
    (parts[row, 0] and parts[row, 1]: exact to 2^-17, no 16-bit overflow), and |carry|^2 as those parts give it
    (so that every product with the carry, in the Gram kernel and W carry, reads the same carry)."""
    row = tl.program_id(0)
    scale = tl.maximum((row % NC) * BS, 1).to(tl.float32)
    acc = tl.zeros((BD,), tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        mean = tl.load(earlier_ptr + row.to(tl.int64) * D + d, mask=d < D, other=0.0) / scale
        hi = mean.to(parts_ptr.dtype.element_ty)
        lo = (mean - hi.to(tl.float32)).to(parts_ptr.dtype.element_ty)
        tl.store(parts_ptr + (row.to(tl.int64) * 2) * D + d, hi, mask=d < D)
        tl.store(parts_ptr + (row.to(tl.int64) * 2 + 1) * D + d, lo, mask=d < D)
        both = hi.to(tl.float32) + lo.to(tl.float32)
        acc += both * both
    tl.store(carry_sq_ptr + row, tl.sum(acc, axis=0) * scale * scale)


@triton.jit
def _earlier_z(wc_ptr, row, e, em, scale, E: tl.constexpr):
    """W carry of a (sequence, chunk) row from W times its two parts (fp32, rows 2 row and 2 row + 1 of wc)."""
    lo = row.to(tl.int64) * 2 * E + e
    return (tl.load(wc_ptr + lo, mask=em, other=0.0) + tl.load(wc_ptr + lo + E, mask=em, other=0.0)) * scale


@triton.jit
def _gram_kernel(x_ptr, w_ptr, parts_ptr, carry_sq_ptr, wc_ptr, logits_ptr, rstd_ptr, S, D, NC, E: tl.constexpr,
                 EPS: tl.constexpr, WITH_Z: tl.constexpr, PREC: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
                 BE: tl.constexpr):
    """One chunk's rstd and, WITH_Z (E <= TILE_MAX_E), its logits, from products of x that need no centred c.

    With carry the sum of the earlier chunks' positions, M_i = carry + sum_{j<i} x_j the earlier sum of chunk
    position i and n_i its count:
      W c_i   = z_i - (W carry + sum_{j<i} z_j) / n_i,                          z = x W^T
      |c_i|^2 = G_ii - 2 (p_i + sum_{j<i} G_ij) / n_i + |M_i|^2 / n_i^2,       G = x x^T, p = x . carry
      |M_i|^2 = |carry|^2 + 2 sum_{j<i} p_j + sum_{j,k<i} G_jk, the last an exclusive scan of 2 sum_{k<j} G_jk + G_jj.
    The loop over the feature blocks is three dots on what it loads (z, G, and p against the carry's mean as the
    16-bit parts hi + lo, the columns of a 16-wide operand that is zero past them); W carry and |carry|^2 come in
    (_carry_parts_kernel, W times the parts in cuBLAS). Only loads that feed the tensor cores sit in the loop, so
    Triton keeps its wgmmas in flight across iterations: with the parts formed and W carry summed in the loop (a
    16-row dot, off the wgmma path), it waited for each dot before the next (sm_90 TTGIR: every wait at pendings
    0). The expansion cancels the shared part of x in fp32 from exact products: c unrounded, as the linearity way's
    logits (module docstring)."""
    seq, chunk = tl.program_id(0), tl.program_id(1)
    row = seq * NC + chunk
    _, rows, sm, n = _positions(seq, chunk, S, BS)
    e = tl.arange(0, BE)
    em = e < E
    part = tl.arange(0, 16)
    scale = tl.maximum(chunk * BS, 1).to(tl.float32)  # the carry's count of positions
    z = tl.zeros((BS, BE), tl.float32)
    gram = tl.zeros((BS, BS), tl.float32)
    p16 = tl.zeros((BS, 16), tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        x = _load_x(x_ptr, rows, sm, d0, D, BD)
        parts = tl.load(parts_ptr + (row.to(tl.int64) * 2 + part[None, :]) * D + d[:, None],
                        mask=(part < 2)[None, :] & (d < D)[:, None], other=0.0)  # (BD, 16): hi, lo, zeros
        gram = tl.dot(x, tl.trans(x), gram, input_precision=PREC)
        p16 = tl.dot(x, parts, p16, input_precision=PREC)
        if WITH_Z:
            w = tl.load(w_ptr + e[None, :] * D + d[:, None], mask=(d < D)[:, None] & em[None, :], other=0.0)  # W^T
            z = tl.dot(x, w, z, input_precision=PREC)
    p = tl.sum(p16, axis=1) * scale
    i = tl.arange(0, BS)
    diag = tl.sum(tl.where(i[:, None] == i[None, :], gram, 0.0), axis=1)
    row_earlier = tl.sum(tl.where(i[None, :] < i[:, None], gram, 0.0), axis=1)  # sum_{j<i} G_ij
    m_sq = tl.load(carry_sq_ptr + row) + 2 * (tl.cumsum(p, axis=0) - p)
    step = 2 * row_earlier + diag
    m_sq += tl.cumsum(step, axis=0) - step
    c_sq = diag - 2 * (p + row_earlier) / n + m_sq / (n * n)
    rstd = tl.rsqrt(tl.maximum(c_sq, 0.0) / D + EPS)  # the expansion's rounding may dip below 0 where c ~ 0
    tl.store(rstd_ptr + rows, rstd, mask=sm)
    if WITH_Z:
        logits = _centred_logits(z, _earlier_z(wc_ptr, row, e, em, scale, E), n, rstd)
        tl.store(logits_ptr + rows[:, None] * E + e[None, :], logits, mask=sm[:, None] & em[None, :])


@triton.jit
def _logits_kernel(z_ptr, wc_ptr, rstd_ptr, logits_ptr, S, NC, E: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr):
    """logits = (z - (the earlier chunks' sum of z + the tile's earlier positions') / n) * rstd for one (sequence,
    chunk, block of experts)."""
    seq, chunk, eblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, rows, sm, n = _positions(seq, chunk, S, BS)
    e = eblk * BE + tl.arange(0, BE)
    em = e < E
    m = sm[:, None] & em[None, :]
    z = tl.load(z_ptr + rows[:, None] * E + e[None, :], mask=m, other=0.0)
    earlier = _earlier_z(wc_ptr, seq * NC + chunk, e, em, tl.maximum(chunk * BS, 1).to(tl.float32), E)
    rstd = tl.load(rstd_ptr + rows, mask=sm, other=0.0)
    logits = _centred_logits(z, earlier, n, rstd)
    tl.store(logits_ptr + rows[:, None] * E + e[None, :], logits, mask=m)


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
    launch(_scan_kernel, (B, triton.cdiv(F, 128)))(sums, out, NC, F, REVERSE=reverse, BC=BC, BF=128, num_warps=4)
    return out


def _earlier_sums(x_TD: Tensor, S: int, BS: int) -> Tensor:
    """(B, chunks, D): per chunk, the sum of x over the sequence's earlier chunks."""
    T, D = x_TD.shape
    BD = 128  # with 2 warps: 1.4x 64 with 4 on the H200 (bench/results/2026-11-25-h200-select-chunk-sums-sweep.json)
    grid = (T // S, triton.cdiv(S, BS), triton.cdiv(D, BD))
    sums = _alloc((grid[0], grid[1], D), torch.float32, x_TD.device)
    launch(_chunk_sums_kernel, grid)(x_TD, sums, S, D, grid[1], BS=BS, BD=BD, num_warps=2)
    return scan_chunks(sums, reverse=False)


def runs_fused(t: Tensor) -> bool:
    """Whether the fused kernels take a tensor of t's dtype: fp64 keeps the definition's fp64 sums (the kernels,
    here and in logit_norm.py, sum in fp32)."""
    return t.dtype != torch.float64


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b summed in fp32 with an fp32 result: 16-bit operands on tensor cores (exact products), fp32 ones in
    fp32 (cuBLAS rounds them to TF32 only where the user allowed it globally)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def prefix_centred_logits(x_TD: Tensor, weight_ED: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """sonic.routing.scores.prefix_centred_logits, fused (see the module docstring)."""
    if not runs_fused(x_TD):
        return scores.prefix_centred_logits(x_TD, weight_ED, seq_len)
    x_TD, w_ED = x_TD.contiguous(), weight_ED.to(x_TD.dtype).contiguous()
    (T, D), E, S = x_TD.shape, w_ED.shape[0], seq_len
    logits_TE = _alloc((T, E), torch.float32, x_TD.device)
    rstd_T = _alloc((T,), torch.float32, x_TD.device)
    if not T:
        return logits_TE, rstd_T
    cfg = _forward_tiles(E)
    BS, B = cfg["BS"], T // S
    earlier_x = _earlier_sums(x_TD, S, BS)  # (B, chunks, D)
    NC = earlier_x.shape[1]
    parts = _alloc((B * NC, 2, D), x_TD.dtype, x_TD.device)
    carry_sq = _alloc((B * NC,), torch.float32, x_TD.device)
    launch(_carry_parts_kernel, (B * NC,))(earlier_x, parts, carry_sq, NC, D, BS=BS, BD=512, num_warps=4)
    wc = _mm_fp32(parts.view(B * NC * 2, D), w_ED.t())  # W times each part: exact products, summed in fp32
    with_z = E <= TILE_MAX_E
    launch(_gram_kernel, (B, NC))(x_TD, w_ED, parts, carry_sq, wc, logits_TE, rstd_T, S, D, NC, E=E, EPS=scores.EPS,
                                  WITH_Z=with_z, PREC="ieee" if x_TD.dtype == torch.float32 else "tf32",
                                  BE=max(16, triton.next_power_of_2(E)) if with_z else 16, **cfg)
    if with_z:
        return logits_TE, rstd_T
    z_TE = _mm_fp32(x_TD, w_ED.t())
    BE = min(128, max(16, triton.next_power_of_2(E)))
    launch(_logits_kernel, (B, NC, triton.cdiv(E, BE)))(z_TE, wc, rstd_T, logits_TE, S, NC, E=E, BS=BS, BE=BE,
                                                        num_warps=4)
    return logits_TE, rstd_T


def prefix_centred_logits_backward(dlogits_TE: Tensor, x_TD: Tensor, weight_ED: Tensor, rstd_T: Tensor,
                                   seq_len: int) -> tuple[Tensor, Tensor]:
    """sonic.routing.scores.prefix_centred_logits_backward, fused: q = P^T dz, dx = q W, dW = q^T x."""
    if not runs_fused(x_TD):
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
    launch(_dz_sums_kernel, (B, NC))(dlogits_TE, rstd_T, sums_e, S, NC, E=E, BS=BS, BE=BE, num_warps=4)
    launch(_q_kernel, (B, NC))(dlogits_TE, rstd_T, scan_chunks(sums_e, reverse=True), q_TE, S, NC, E=E, BS=BS, BE=BE,
                       num_warps=4)
    return q_TE @ w_ED, (q_TE.t() @ x_TD).to(weight_ED.dtype)
