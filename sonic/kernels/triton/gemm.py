"""Triton kernels of the expert computation: grouped GEMMs with fused gathers and epilogues.

Tile scheduling (no host sync): a varlen-M kernel is launched over an upper bound of
row tiles, cdiv(R, BM) + E, times the column tiles. `tile_map_kernel` writes, on device,
the expert and first row of every real tile and the real tile count; programs past it
return at once. Varlen-K kernels (dW1, dW2) are launched over E x output tiles and loop
over their expert's rows read from expert_offsets_E1.

Row indices are clamped to the expert's last row for the loads, so the K loops of the
varlen-M kernels carry no row masks (tails are dropped at the store). Where TMA can load both
operands of a varlen-M product (Hopper, 16-bit, aligned, BK dividing K), a persistent kernel
(`varlen_m_tma_kernel`) runs it instead; likewise the up-projection loads W1 by TMA
(`up_proj_tma_kernel`), its gathered X by pointers, and the weight gradients their contiguous
operand, dH or A' (`varlen_k_tma_kernel`), the gathered one by pointers.

Legend: R routed rows, T tokens, D hidden, N expert width, F = 2N (gate/up interleaved),
E experts; BM/BN/BK tile sizes.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_map_kernel(expert_offsets_E1, tile_expert_M, tile_row_M, num_tiles_1, E,
                    BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr):
    """Program e: write expert e's row tiles (expert id, first row) at its tile offset."""
    e = tl.program_id(0)
    before = 0
    for e0 in range(0, E, BLOCK_E):  # tiles of experts < e
        idx = e0 + tl.arange(0, BLOCK_E)
        m = idx < e
        lo = tl.load(expert_offsets_E1 + idx, mask=m, other=0)
        hi = tl.load(expert_offsets_E1 + idx + 1, mask=m, other=0)
        before += tl.sum((hi - lo + BM - 1) // BM)
    row0 = tl.load(expert_offsets_E1 + e)
    count = tl.load(expert_offsets_E1 + e + 1) - row0
    n_tiles = (count + BM - 1) // BM
    for j0 in range(0, n_tiles, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        m = j < n_tiles
        tl.store(tile_expert_M + before + j, tl.zeros_like(j) + e, mask=m)
        tl.store(tile_row_M + before + j, row0 + j * BM, mask=m)
    if e == E - 1:
        tl.store(num_tiles_1, before + n_tiles)


@triton.jit
def _tile_lookup(tile_expert_M, tile_row_M, num_tiles_1, expert_offsets_E1, m_tile):
    """(valid, expert, first row, end row) of row tile m_tile."""
    valid = m_tile < tl.load(num_tiles_1)
    e = tl.load(tile_expert_M + m_tile, mask=valid, other=0)
    row0 = tl.load(tile_row_M + m_tile, mask=valid, other=0)
    row_end = tl.load(expert_offsets_E1 + e + 1)
    return valid, e, row0, row_end


@triton.jit
def _up_epilogue(acc_g, acc_u, e, n_tile, rows, row_end, b1_EF, h_RF, a_RN, F,
                 HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Both up-projection kernels' stores of one (row tile, BN columns of H): H (+b1) and A = SwiGLU(H), with A
    computed from H rounded to the output dtype, exactly as the reference does."""
    N = F // 2
    j = n_tile * (BN // 2) + tl.arange(0, BN // 2)  # SwiGLU output columns of this tile
    jm = j < N
    if HAS_BIAS:
        acc_g += tl.load(b1_EF + e * F + 2 * j, mask=jm, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b1_EF + e * F + 2 * j + 1, mask=jm, other=0.0).to(tl.float32)[None, :]
    hg = acc_g.to(h_RF.dtype.element_ty)
    hu = acc_u.to(h_RF.dtype.element_ty)
    rows64 = rows.to(tl.int64)
    rm = rows < row_end
    # H columns interleaved back (gate j, up j) so the store is contiguous
    h = tl.reshape(tl.join(hg, hu), (BM, BN))
    f = n_tile * BN + tl.arange(0, BN)
    tl.store(h_RF + rows64[:, None] * F + f[None, :], h, mask=rm[:, None] & (f < F)[None, :])
    gf = hg.to(tl.float32)
    act = gf * tl.sigmoid(gf) * hu.to(tl.float32)
    tl.store(a_RN + rows64[:, None] * N + j[None, :], act.to(a_RN.dtype.element_ty), mask=rm[:, None] & jm[None, :])


@triton.jit(do_not_specialize=["R"])
def up_proj_kernel(x_TD, token_idx_R, w1_EFD, b1_EF, h_RF, a_RN,
                   tile_expert_M, tile_row_M, num_tiles_1, expert_offsets_E1, R, D, F,
                   HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """H = X[token_idx] W1_e^T (+b1), A = SwiGLU(H), for one (row tile, BN columns of H).

    Gate and up rows of W1 are interleaved, so the tile's BN/2 gate rows (even) and BN/2
    up rows (odd) are loaded as two B operands: SwiGLU is elementwise on two accumulators.
    A is computed from H rounded to the output dtype, exactly as the reference does.
    """
    N = F // 2
    HN: tl.constexpr = BN // 2
    NUM_N = tl.cdiv(F, BN)
    pid = tl.program_id(0)
    m_tile = pid // NUM_N
    n_tile = pid % NUM_N
    valid, e, row0, row_end = _tile_lookup(tile_expert_M, tile_row_M, num_tiles_1,
                                           expert_offsets_E1, m_tile)
    if valid:
        rows = row0 + tl.arange(0, BM)
        tok = tl.load(token_idx_R + tl.minimum(rows, row_end - 1)).to(tl.int64)
        j = n_tile * HN + tl.arange(0, HN)  # SwiGLU output columns of this tile
        jm = j < N
        offs_k = tl.arange(0, BK)
        a_ptrs = x_TD + tok[:, None] * D + offs_k[None, :]
        w_base = w1_EFD + e.to(tl.int64) * F * D
        g_ptrs = w_base + (2 * j)[None, :] * D + offs_k[:, None]
        u_ptrs = g_ptrs + D
        acc_g = tl.zeros((BM, HN), dtype=tl.float32)
        acc_u = tl.zeros((BM, HN), dtype=tl.float32)
        for k in range(0, D, BK):
            if EVEN_K:
                a = tl.load(a_ptrs)
                g = tl.load(g_ptrs, mask=jm[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=jm[None, :], other=0.0)
            else:
                km = offs_k < D - k
                a = tl.load(a_ptrs, mask=km[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=km[:, None] & jm[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=km[:, None] & jm[None, :], other=0.0)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BK
            g_ptrs += BK
            u_ptrs += BK
        _up_epilogue(acc_g, acc_u, e, n_tile, rows, row_end, b1_EF, h_RF, a_RN, F, HAS_BIAS, BM, BN)


@triton.jit(do_not_specialize=["R"])
def up_proj_tma_kernel(x_TD, token_idx_R, g_desc, u_desc, b1_EF, h_RF, a_RN,
                       tile_expert_M, tile_row_M, num_tiles_1, expert_offsets_E1, R, D, F,
                       HAS_BIAS: tl.constexpr, NUM_SMS: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """up_proj_kernel with W1's gate and up rows loaded by TMA (g_desc, u_desc: every expert's even and odd rows of
    W1, (E*N, D) each), persistent: NUM_SMS programs walk the (row tile, column tile) pairs. X stays a gather by
    pointers (Hopper's TMA cannot gather rows). The tile loop is not flattened into the K loop here: with the
    gathered loads in it, that ran slower than one tile at a time (the varlen-M kernels gain from it). The
    launcher takes this path only when BK divides D; a tile's gate/up rows past the expert's N are dropped at the
    store.
    """
    N = F // 2
    HN: tl.constexpr = BN // 2
    NUM_N = tl.cdiv(F, BN)
    num_tiles = tl.load(num_tiles_1) * NUM_N
    k_steps = D // BK
    offs_k = tl.arange(0, BK)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS):
        m_tile = tile // NUM_N
        n_tile = tile % NUM_N
        e = tl.load(tile_expert_M + m_tile)
        row0 = tl.load(tile_row_M + m_tile)
        row_end = tl.load(expert_offsets_E1 + e + 1)
        rows = row0 + tl.arange(0, BM)
        tok = tl.load(token_idx_R + tl.minimum(rows, row_end - 1)).to(tl.int64)
        w_row = e * N + n_tile * HN
        acc_g = tl.zeros((BM, HN), dtype=tl.float32)
        acc_u = tl.zeros((BM, HN), dtype=tl.float32)
        for ks in range(k_steps):
            k = ks * BK
            a = tl.load(x_TD + tok[:, None] * D + (k + offs_k)[None, :])
            acc_g = tl.dot(a, g_desc.load([w_row, k]).T, acc_g)
            acc_u = tl.dot(a, u_desc.load([w_row, k]).T, acc_u)
        _up_epilogue(acc_g, acc_u, e, n_tile, rows, row_end, b1_EF, h_RF, a_RN, F, HAS_BIAS, BM, BN)


@triton.jit(do_not_specialize=["R"])
def varlen_m_gemm_kernel(a_RK, b_EKN, bias_EN, out_RN,
                         tile_expert_M, tile_row_M, num_tiles_1, expert_offsets_E1, R, K, N,
                         stride_bk, stride_bn, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                         EVEN_N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[rows of e] = A[rows of e] B_e (+bias_e), contiguous rows in and out.

    B_e is addressed through strides, so the down-projection (B = W2_e^T: w2_EDN with
    stride_bk=1, stride_bn=N_expert) and dX~ (B = W1_e: w1_EFD with stride_bk=D,
    stride_bn=1) share the kernel.
    """
    NUM_N = tl.cdiv(N, BN)
    pid = tl.program_id(0)
    m_tile = pid // NUM_N
    n_tile = pid % NUM_N
    valid, e, row0, row_end = _tile_lookup(tile_expert_M, tile_row_M, num_tiles_1,
                                           expert_offsets_E1, m_tile)
    if valid:
        rows = row0 + tl.arange(0, BM)
        src = tl.minimum(rows, row_end - 1).to(tl.int64)
        cols = n_tile * BN + tl.arange(0, BN)
        cm = cols < N
        offs_k = tl.arange(0, BK)
        a_ptrs = a_RK + src[:, None] * K + offs_k[None, :]
        b_ptrs = b_EKN + e.to(tl.int64) * K * N + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            if EVEN_K and EVEN_N:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                km = offs_k < K - k
                a = tl.load(a_ptrs, mask=km[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=km[:, None] & cm[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK * stride_bk
        if HAS_BIAS:
            acc += tl.load(bias_EN + e * N + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        om = (rows < row_end)[:, None] & cm[None, :]
        tl.store(out_RN + rows.to(tl.int64)[:, None] * N + cols[None, :],
                 acc.to(out_RN.dtype.element_ty), mask=om)


@triton.jit(do_not_specialize=["R"])
def varlen_m_tma_kernel(a_desc, b_desc, bias_EN, out_RN,
                        tile_expert_M, tile_row_M, num_tiles_1, expert_offsets_E1, R, K, N, B_ROWS,
                        HAS_BIAS: tl.constexpr, B_NK: tl.constexpr, NUM_SMS: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """varlen_m_gemm_kernel's product with both operands loaded by TMA, persistent: NUM_SMS programs walk the
    (row tile, column tile) pairs, and the tile loop is flattened into the K loop so that the next tile's loads
    are in flight during this tile's epilogue. The down-projection's K is the expert width (4-8 steps of BK), so
    its one-tile-per-program grid spent much of each tile outside the K loop.

    A's tile [row0, row0 + BM) may run past the expert's last row into the next expert's rows (or past R, where
    TMA fills zeros): those rows are computed and dropped at the store, as the pointer kernel's clamped rows are.
    b_desc holds every expert's B_ROWS rows: B_NK, (E*N, K) with rows n (W2 as stored, the tile transposed for
    the product); else (E*K, N) with rows k (W1 as stored). The launcher takes this path only when BK divides K,
    so no K step reads into the next expert's rows of B.
    """
    NUM_N = tl.cdiv(N, BN)
    num_tiles = tl.load(num_tiles_1) * NUM_N
    k_steps = K // BK
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        m_tile = tile // NUM_N
        n_tile = tile % NUM_N
        e = tl.load(tile_expert_M + m_tile)
        row0 = tl.load(tile_row_M + m_tile)
        row_end = tl.load(expert_offsets_E1 + e + 1)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(k_steps):
            k = ks * BK
            a = a_desc.load([row0, k])
            if B_NK:
                b = b_desc.load([e * B_ROWS + n_tile * BN, k]).T
            else:
                b = b_desc.load([e * B_ROWS + k, n_tile * BN])
            acc = tl.dot(a, b, acc)
        rows = row0 + tl.arange(0, BM)
        cols = n_tile * BN + tl.arange(0, BN)
        cm = cols < N
        if HAS_BIAS:
            acc += tl.load(bias_EN + e * N + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        om = (rows < row_end)[:, None] & cm[None, :]
        tl.store(out_RN + rows.to(tl.int64)[:, None] * N + cols[None, :],
                 acc.to(out_RN.dtype.element_ty), mask=om)


@triton.jit
def _dh_epilogue(acc, c0, rows64, rm, s, N, F, h_RF, dh_RF, aprime_RN,
                 BM: tl.constexpr, HB: tl.constexpr):
    """dH / A' stores for columns [c0, c0 + HB) of one row tile; returns <dA', A> over them."""
    cols = c0 + tl.arange(0, HB)
    om = rm[:, None] & (cols < N)[None, :]
    # the (BM, 2*HB) slab of H holding these columns' gate/up pairs, loaded contiguously
    f = 2 * c0 + tl.arange(0, 2 * HB)
    fm = rm[:, None] & (f < F)[None, :]
    h = tl.load(h_RF + rows64[:, None] * F + f[None, :], mask=fm, other=0.0)
    hg, hu = tl.split(tl.reshape(h, (BM, HB, 2)))
    hg = hg.to(tl.float32)
    hu = hu.to(tl.float32)
    sig = tl.sigmoid(hg)
    silu = hg * sig
    act = silu * hu
    tl.store(aprime_RN + rows64[:, None] * N + cols[None, :],
             (act * s[:, None]).to(aprime_RN.dtype.element_ty), mask=om)
    ds = tl.sum(acc * act, axis=1)
    da = acc * s[:, None]
    dg = (da * hu * (sig + silu * (1.0 - sig))).to(dh_RF.dtype.element_ty)
    du = (da * silu).to(dh_RF.dtype.element_ty)
    tl.store(dh_RF + rows64[:, None] * F + f[None, :], tl.reshape(tl.join(dg, du), (BM, 2 * HB)),
             mask=fm)
    return ds


@triton.jit
def _halves(acc, BM: tl.constexpr, BN: tl.constexpr):
    """A (BM, BN) accumulator's column halves [0, BN/2) and [BN/2, BN), in registers."""
    return tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ptrs, marked evict-last so that streaming loads do not push them out before
    their use: no register is held and nothing waits, and a later load of them waits on L2 rather than HBM."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["R"])
def dh_kernel(dout_TD, token_idx_R, scores_R, w2_EDN, b2_ED, h_RF,
              dh_RF, aprime_RN, ds_part_JR,
              tile_expert_M, tile_row_M, num_tiles_1, expert_offsets_E1, R, D, N,
              HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PREFETCH_H: tl.constexpr,
              LINE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """dA' = dO[token_idx] W2_e for BN columns of N, then the whole dH epilogue.

    Writes dH = dSwiGLU(s*dA', H), A' = s*A (A recomputed from the re-loaded H) and this
    column tile's partial dS = <dA', A>; the partials of a row are summed afterwards in a
    fixed order (deterministic). The n_tile == 0 program adds <dO, b2_e> when biased.
    The main loop is one BN-wide dot: two BN/2-wide dots, one per epilogue half, re-read
    dO's tile from shared memory per dot. The register-heavy epilogue then runs on column
    quarters of the accumulator, one at a time (ptxas for sm_90, 128 x 128 x 64, 8 warps:
    182 registers, no spill; by halves it spilled 136 bytes, the two-dot kernel 192).
    With PREFETCH_H (on the GPU; the interpreter has no inline PTX) the tile's H slab is asked into L2,
    evict-last, before the main loop, so the epilogue's re-load of it waits on L2, not HBM: 1-7% less time
    at 30B's, 120B's and sonic_7b's shapes on an H200, where a plain prefetch gained nothing (its lines were
    evicted by the main loop's streaming loads first; bench/results/2026-11-28-h200-triton-dh-prefetch-ab.json).
    """
    F = 2 * N
    NUM_N = tl.cdiv(N, BN)
    pid = tl.program_id(0)
    m_tile = pid // NUM_N
    n_tile = pid % NUM_N
    valid, e, row0, row_end = _tile_lookup(tile_expert_M, tile_row_M, num_tiles_1,
                                           expert_offsets_E1, m_tile)
    if valid:
        rows = row0 + tl.arange(0, BM)
        rm = rows < row_end
        tok = tl.load(token_idx_R + tl.minimum(rows, row_end - 1)).to(tl.int64)
        c0 = n_tile * BN
        cols = c0 + tl.arange(0, BN)
        cm = cols < N
        offs_k = tl.arange(0, BK)
        a_ptrs = dout_TD + tok[:, None] * D + offs_k[None, :]
        b_ptrs = w2_EDN + e.to(tl.int64) * D * N + offs_k[:, None] * N + cols[None, :]
        if PREFETCH_H:  # the epilogue's H slab into L2 during the main loop, LINE elements per 128-byte line
            lines = tl.minimum(2 * c0 + tl.arange(0, 2 * BN // LINE) * LINE, F - 1)
            _prefetch_l2(h_RF + tl.minimum(rows, row_end - 1).to(tl.int64)[:, None] * F + lines[None, :])
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        dob2 = tl.zeros((BM,), dtype=tl.float32)
        for k in range(0, D, BK):
            km = offs_k < D - k
            if EVEN_K and EVEN_N:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=km[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=km[:, None] & cm[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            if HAS_BIAS:
                bias = tl.load(b2_ED + e * D + k + offs_k, mask=km, other=0.0).to(tl.float32)
                dob2 += tl.sum(a.to(tl.float32) * bias[None, :], axis=1)
            a_ptrs += BK
            b_ptrs += BK * N
        rows64 = rows.to(tl.int64)
        s = tl.load(scores_R + rows, mask=rm, other=0.0).to(tl.float32)
        # four column quarters, one epilogue at a time: halves of a 128 x 128 tile still spilled
        HB: tl.constexpr = BN // 2
        QB: tl.constexpr = BN // 4
        acc0, acc1 = _halves(acc, BM, BN)
        q0, q1 = _halves(acc0, BM, HB)
        ds = _dh_epilogue(q0, c0, rows64, rm, s, N, F, h_RF, dh_RF, aprime_RN, BM, QB)
        ds += _dh_epilogue(q1, c0 + QB, rows64, rm, s, N, F, h_RF, dh_RF, aprime_RN, BM, QB)
        q2, q3 = _halves(acc1, BM, HB)
        ds += _dh_epilogue(q2, c0 + HB, rows64, rm, s, N, F, h_RF, dh_RF, aprime_RN, BM, QB)
        ds += _dh_epilogue(q3, c0 + HB + QB, rows64, rm, s, N, F, h_RF, dh_RF, aprime_RN, BM, QB)
        if HAS_BIAS:
            ds += tl.where(n_tile == 0, dob2, 0.0)
        tl.store(ds_part_JR + n_tile.to(tl.int64) * R + rows64, ds, mask=rm)


@triton.jit
def varlen_k_gemm_kernel(p_XI, p_idx_R, q_YJ, q_idx_R, weight_R, out_EIJ, bias_grad_EI,
                         expert_offsets_E1, I, J, EVEN_IJ: tl.constexpr, GATHER_P: tl.constexpr,
                         GATHER_Q: tl.constexpr, BIAS_GRAD: tl.constexpr, WEIGHTED: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out_e = P[rows of e]^T Q[rows of e]: a weight gradient, reducing over e's rows.

    P rows (I wide) and Q rows (J wide) are either the routed rows themselves or gathered
    through an index (the token of each row), so dO and X are never materialised per row.
    Every load is by pointers, masked at the expert's last row. With BIAS_GRAD the j-tile-0
    programs also write sum_rows (w *) P, the bias gradient. Empty experts write zeros.
    """
    e, i0, j0, lo, hi = _varlen_k_tile(expert_offsets_E1, I, J, BM, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    bacc = tl.zeros((BM,), dtype=tl.float32)
    for r0 in range(lo, hi, BK):
        acc, bacc = _varlen_k_step(p_XI, p_idx_R, q_YJ, q_idx_R, weight_R, acc, bacc, r0, hi, i0, j0, I, J,
                                   False, False, EVEN_IJ, GATHER_P, GATHER_Q, BIAS_GRAD, WEIGHTED, BM, BN, BK)
    _varlen_k_store(acc, bacc, out_EIJ, bias_grad_EI, e, i0, j0, I, J, BIAS_GRAD, BM, BN)


@triton.jit
def _varlen_k_tile(expert_offsets_E1, I, J, BM: tl.constexpr, BN: tl.constexpr):
    """This program's (expert, first output row, first output column) and the expert's rows [lo, hi)."""
    NUM_I = tl.cdiv(I, BM)
    NUM_J = tl.cdiv(J, BN)
    pid = tl.program_id(0)
    e = pid // (NUM_I * NUM_J)
    rem = pid % (NUM_I * NUM_J)
    lo = tl.load(expert_offsets_E1 + e)
    hi = tl.load(expert_offsets_E1 + e + 1)
    return e, (rem // NUM_J) * BM, (rem % NUM_J) * BN, lo, hi


@triton.jit
def _varlen_k_operand(t, idx_R, r0, rows, rm, c0, C, TMA: tl.constexpr, TAIL: tl.constexpr,
                      EVEN_IJ: tl.constexpr, GATHER: tl.constexpr, BC: tl.constexpr):
    """Rows [r0, r0 + BK) x columns [c0, c0 + BC) of one varlen-K operand (C columns). By pointers, masked at the
    expert's last row: through idx_R if GATHER, else the rows themselves. Contiguous with TMA, t is a TMA
    descriptor, whose box in the TAIL step has the rows past the expert (rm false) zeroed."""
    if GATHER or not TMA:
        cols = c0 + tl.arange(0, BC)
        if GATHER:
            row = tl.load(idx_R + rows, mask=rm, other=0).to(tl.int64)
        else:
            row = rows.to(tl.int64)
        m = rm[:, None] if EVEN_IJ else rm[:, None] & (cols < C)[None, :]
        out = tl.load(t + row[:, None] * C + cols[None, :], mask=m, other=0.0)
    else:
        out = t.load([r0, c0])
        if TAIL:
            out = tl.where(rm[:, None], out, 0.0)
    return out


@triton.jit
def _varlen_k_step(p, p_idx_R, q, q_idx_R, weight_R, acc, bacc, r0, hi, i0, j0, I, J,
                   TMA: tl.constexpr, TAIL: tl.constexpr, EVEN_IJ: tl.constexpr, GATHER_P: tl.constexpr,
                   GATHER_Q: tl.constexpr, BIAS_GRAD: tl.constexpr, WEIGHTED: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One BK-row step of a varlen-K kernel: P rows [r0, r0 + BK) x columns [i0, i0 + BM), Q's x [j0, j0 + BN).
    A gathered operand is a pointer load through its index. A contiguous one is a pointer load too, or with TMA a
    TMA box, which past the expert's last row reads the next expert's rows (zeros past R): in the TAIL step those
    rows are zeroed, so the product and the bias sums are the pointer kernel's exactly."""
    rows = r0 + tl.arange(0, BK)
    rm = rows < hi
    pt = _varlen_k_operand(p, p_idx_R, r0, rows, rm, i0, I, TMA, TAIL, EVEN_IJ, GATHER_P, BM)
    qt = _varlen_k_operand(q, q_idx_R, r0, rows, rm, j0, J, TMA, TAIL, EVEN_IJ, GATHER_Q, BN)
    acc = tl.dot(tl.trans(pt), qt, acc)
    if BIAS_GRAD:  # (weighted) column sums of P: the bias gradient
        pf = pt.to(tl.float32)
        if WEIGHTED:
            pf = pf * tl.load(weight_R + rows, mask=rm, other=0.0).to(tl.float32)[:, None]
        bacc += tl.sum(pf, axis=0)
    return acc, bacc


@triton.jit
def _varlen_k_store(acc, bacc, out_EIJ, bias_grad_EI, e, i0, j0, I, J, BIAS_GRAD: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
    """A varlen-K tile's stores: out_e's (BM, BN) block, and with BIAS_GRAD (j tile 0 only) the bias sums."""
    offs_i = i0 + tl.arange(0, BM)
    offs_j = j0 + tl.arange(0, BN)
    im = offs_i < I
    tl.store(out_EIJ + e.to(tl.int64) * I * J + offs_i[:, None] * J + offs_j[None, :],
             acc.to(out_EIJ.dtype.element_ty), mask=im[:, None] & (offs_j < J)[None, :])
    if BIAS_GRAD:
        if j0 == 0:
            tl.store(bias_grad_EI + e * I + offs_i, bacc.to(bias_grad_EI.dtype.element_ty), mask=im)


@triton.jit
def varlen_k_tma_kernel(p, p_idx_R, q, q_idx_R, weight_R, out_EIJ, bias_grad_EI,
                        expert_offsets_E1, I, J, EVEN_IJ: tl.constexpr, GATHER_P: tl.constexpr,
                        GATHER_Q: tl.constexpr, BIAS_GRAD: tl.constexpr, WEIGHTED: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """varlen_k_gemm_kernel's product with its contiguous operand loaded by TMA: p and q are (R, I) / (R, J)
    descriptors with BK x BM / BK x BN boxes where not gathered, else the (T, I) / (T, J) tensors read through
    p_idx_R / q_idx_R (dW2: dO gathered, A' by TMA; dW1: dH by TMA, X gathered). The expert's full BK-row steps
    use the TMA box as loaded; its last partial step is the TAIL step, which masks it."""
    e, i0, j0, lo, hi = _varlen_k_tile(expert_offsets_E1, I, J, BM, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    bacc = tl.zeros((BM,), dtype=tl.float32)
    full = (hi - lo) // BK
    for s in range(full):
        acc, bacc = _varlen_k_step(p, p_idx_R, q, q_idx_R, weight_R, acc, bacc, lo + s * BK, hi, i0, j0, I, J,
                                   True, False, EVEN_IJ, GATHER_P, GATHER_Q, BIAS_GRAD, WEIGHTED, BM, BN, BK)
    if lo + full * BK < hi:
        acc, bacc = _varlen_k_step(p, p_idx_R, q, q_idx_R, weight_R, acc, bacc, lo + full * BK, hi, i0, j0, I, J,
                                   True, True, EVEN_IJ, GATHER_P, GATHER_Q, BIAS_GRAD, WEIGHTED, BM, BN, BK)
    _varlen_k_store(acc, bacc, out_EIJ, bias_grad_EI, e, i0, j0, I, J, BIAS_GRAD, BM, BN)


@triton.jit
def gather_sum_kernel(rows_RD, weight_R, token_offsets_T1, rows_by_token_R, out_TD,
                      D, WEIGHTED: tl.constexpr, BLOCK_D: tl.constexpr,
                      CHUNK: tl.constexpr):
    """out_t = sum over token t's rows of (w_r *) rows_r: a deterministic gather-sum.

    Rows are visited in rows_by_token order, CHUNK at a time, accumulated in fp32.
    """
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    lo = tl.load(token_offsets_T1 + t)
    hi = tl.load(token_offsets_T1 + t + 1)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j0 in range(lo, hi, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        jm = j < hi
        r = tl.load(rows_by_token_R + j, mask=jm, other=0).to(tl.int64)
        v = tl.load(rows_RD + r[:, None] * D + d[None, :], mask=jm[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)
        if WEIGHTED:
            v = v * tl.load(weight_R + r, mask=jm, other=0.0).to(tl.float32)[:, None]
        acc += tl.sum(v, axis=0)
    tl.store(out_TD + t.to(tl.int64) * D + d, acc.to(out_TD.dtype.element_ty), mask=dm)
