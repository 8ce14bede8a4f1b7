"""Epilogues of the grouped GEMM: what happens to the fp32 accumulator of one tile.

Each consumer thread holds the wgmma fragment ((2, 2, tile_n/8), MMA_M, 1): register
i = v0 + 2*v1 + 4*nb + (tile_n/2)*mm sits at tile row r0 + 8*v1 + 64*mm (128*mm in a 256-row
cooperative tile) and column c0 + v0 + 8*nb, with (r0, c0) the thread's first coordinate
(MMA_M = 2 when one ping-pong warpgroup owns all 128 rows, or a cooperative one 128 of 256).
Registers 2j and 2j+1 are therefore adjacent columns of one row, which is what makes the
interleaved gate/up SwiGLU layout thread-local. The staged epilogues read rows and columns from
the identity fragment, never from this formula; the direct ones (DirectStoreEpilogue,
DirectSwiGLUEpilogue, DirectDSwiGLUEpilogue) take rows from it but rely on the formula's columns, c0 = 2 * (lane % 4):
the 4 lanes of a quad share a row and hold its 8-column blocks between them, which their
transposes regroup (the staged-vs-direct test compares the two bit for bit).

A staged epilogue walks the tile in sub-tiles of `epi_n` columns: it writes results (in the output's
16-bit type) into a padded shared-memory staging tile (conflict-free 32-bit stores), waits on the consumer
named barrier, then the epilogue's threads (one or both consumer warpgroups) copy the
staging tile out with 16-byte stores predicated on the expert's last row. Two staging buffers alternate, so one barrier per
sub-tile suffices (and one more per tile where the count of sub-tiles is odd: `EpilogueContext.sub_tiles`).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr


LOG2E = math.log2(math.e)
PAD = 8  # elements of row padding in the staging tiles (16 bytes)


def _staging(sEpi: cute.Tensor, offset: int, rows: int, cols: int, dt) -> cute.Tensor:
    """A (rows, cols) tile of the 16-bit output type dt with padded rows, carved out of the epilogue smem."""
    return cute.make_tensor(cute.recast_ptr(sEpi.iterator + offset, dtype=dt),
                            cute.make_layout((rows, cols), stride=(cols + PAD, 1)))


def _staging_elems(rows: int, cols: int) -> int:
    return rows * (cols + PAD)


@cute.jit
def _copy_out(ctx, sT: cute.Tensor, gT: cute.Tensor, rows_valid: Int32, cols_valid: Int32):
    """Cooperative 16-byte copy of a staged (rows, cols) tile to global, rows/cols predicated."""
    rows, cols = cute.size(sT, mode=[0]), cute.size(sT, mode=[1])
    chunks_per_row = cols // 8
    total = rows * chunks_per_row
    for q in cutlass.range_constexpr((total + ctx.nthreads - 1) // ctx.nthreads):
        c = ctx.tid + q * ctx.nthreads
        r = c // chunks_per_row
        cc = c - r * chunks_per_row
        if c < total and r < rows_valid and cc * 8 < cols_valid:
            src = cute.local_tile(sT[r, None], (8,), (cc,))
            dst = _aligned(cute.local_tile(gT[r, None], (8,), (cc,)), 16)
            cute.autovec_copy(src, dst)


def _aligned(t: cute.Tensor, align: int) -> cute.Tensor:
    """The same global tensor with its pointer declared `align`-byte aligned.

    Row strides (D, N, 2N) are multiples of 8 elements and column offsets are multiples of
    the vector width, which the layout algebra cannot see through dynamic row offsets."""
    ptr = cute.make_ptr(t.element_type, t.iterator.toint(), cute.AddressSpace.gmem, assumed_align=align)
    return cute.make_tensor(ptr, t.layout)


@cute.jit
def _sigmoid(x: Float32) -> Float32:
    return cute.arch.rcp_approx(1.0 + cute.math.exp2(-x * LOG2E, fastmath=True))


class StoreEpilogue:
    """C -> bf16, stored contiguously (down-projection Y, dX~, and the weight gradients).

    varlen-M: args = (mC (R, N),); rows [start, start + length) of the segment.
    varlen-K: args = (mC (M, N, E),); the tile (m_tile, n_tile) of expert `expert`.
    """

    def smem_elems(self, spec) -> int:
        return 2 * _staging_elems(spec.tile_m, spec.epi_n)

    @cute.jit
    def apply(self, ctx):
        spec = ctx.spec
        bm, bn, en = spec.tile_m, spec.tile_n, spec.epi_n
        mC = ctx.args[0]
        col0 = ctx.nt * bn
        if const_expr(spec.varlen == "m"):
            gC = cute.domain_offset((ctx.start, col0), mC)
            rows_valid = ctx.length
            cols_valid = mC.shape[1] - col0
        else:
            gC = cute.domain_offset((ctx.mt * bm, col0), mC[None, None, ctx.expert])
            rows_valid = mC.shape[0] - ctx.mt * bm
            cols_valid = mC.shape[1] - col0
        buf_elems = _staging_elems(bm, en)
        for j in ctx.sub_tiles():
            sC = _staging(ctx.sEpi, (j % 2) * buf_elems, bm, en, mC.element_type)
            for i, r, c in ctx.pairs(j):
                sC[r, c] = ctx.acc[i].to(mC.element_type)
                sC[r, c + 1] = ctx.acc[i + 1].to(mC.element_type)
            ctx.barrier.arrive_and_wait()
            _copy_out(ctx, sC, cute.domain_offset((0, j * en), gC), rows_valid, cols_valid - j * en)


class _FromRegisters:
    """A register-direct epilogue: no staging tiles, so the ring gets the shared memory."""

    def smem_elems(self, spec) -> int:
        return 64  # unused: a shared-storage member cannot be empty


class DirectStoreEpilogue(_FromRegisters, StoreEpilogue):
    """StoreEpilogue's C stored from registers, with no shared memory and no barrier (down-projection Y, dX~, dW1,
    dW2; args as StoreEpilogue's).

    A row's 8 consecutive columns are spread over the 4 lanes of a quad (2 each, per 8-column block nb); a
    4 x 4 transpose of packed column pairs over 4 nb blocks (two butterfly shuffle stages) gives each lane the 8
    columns of one block, which it stores in 16 bytes: a warp writes 8 rows x 64 bytes, as the staged copy-out did,
    without its shared-memory round trip, which cost the down-projection 13-21% at n = 512
    (bench/results/2026-11-26-h200-down-epilogue-diag.json). Needs tile_n % 32 == 0."""

    @cute.jit
    def apply(self, ctx):
        spec = ctx.spec
        bm, bn = spec.tile_m, spec.tile_n
        assert bn % 32 == 0, "the quad transpose takes 4 blocks of 8 columns at a time"
        mC = ctx.args[0]
        dt = mC.element_type
        col0 = ctx.nt * bn
        if const_expr(spec.varlen == "m"):
            gC = cute.domain_offset((ctx.start, col0), mC)
            rows_valid = ctx.length
        else:
            gC = cute.domain_offset((ctx.mt * bm, col0), mC[None, None, ctx.expert])
            rows_valid = mC.shape[0] - ctx.mt * bm
        cols_valid = mC.shape[1] - col0
        q = cute.arch.lane_idx() % 4
        for i0, row in ctx.rows():
            for g in cutlass.range_constexpr(bn // 32):
                m = [_pack(ctx.acc[i0 + 4 * (4 * g + k)], ctx.acc[i0 + 4 * (4 * g + k) + 1], dt) for k in range(4)]
                m = _quad_transpose(m, q)  # m[k]: columns 2k, 2k + 1 of block 4g + q
                col = 8 * (4 * g + q)
                if row < rows_valid and col < cols_valid:
                    _store16(gC, row, col, m, dt)


def _store16(gC: cute.Tensor, row, col, words: list, dt):
    """Four 32-bit words (8 16-bit values) to columns col..col+7 of row `row`, one 16-byte store."""
    out = cute.make_rmem_tensor((4,), Uint32)
    for k in range(4):  # a plain helper (not preprocessed): this loop unrolls as Python
        out[k] = words[k]
    dst = _aligned(cute.local_tile(gC[row, None], (8,), (col // 8,)), 16)
    cute.autovec_copy(cute.recast_tensor(out, dt), dst)


def _pack(a, b, dt) -> Uint32:
    """Two values as one 32-bit word of two 16-bit floats of type dt (a in the low half)."""
    v = cute.make_rmem_tensor((2,), dt)
    v[0] = a.to(dt)
    v[1] = b.to(dt)
    return cute.recast_tensor(v, Uint32)[0]


def _quad_transpose(m: list, q):
    """Lane q of each quad holds m[k] = entry (q, k) of a 4 x 4 matrix; afterwards it holds entry (k, q): per
    index bit b, the lanes q and q ^ b swap the entries whose bit b differs from their own."""
    for b in (1, 2):
        hi = (q & b) != 0
        for k in (k for k in range(4) if not k & b):
            send = Uint32(cutlass.select_(hi, m[k], m[k ^ b]))
            recv = cute.arch.shuffle_sync_bfly(send, offset=b)
            m[k], m[k ^ b] = Uint32(cutlass.select_(hi, recv, m[k])), Uint32(cutlass.select_(hi, m[k ^ b], recv))
    return m


class SwiGLUEpilogue:
    """Up-projection: store H (bf16, gate/up interleaved) and A = silu(gate) * up.

    A is computed from the bf16-rounded H, exactly as the backward recomputes it.
    args = (mH (R, 2N), mA (R, N)).
    """

    def smem_elems(self, spec) -> int:
        return 2 * (_staging_elems(spec.tile_m, spec.epi_n) + _staging_elems(spec.tile_m, spec.epi_n // 2))

    @cute.jit
    def apply(self, ctx):
        spec = ctx.spec
        bm, bn, en = spec.tile_m, spec.tile_n, spec.epi_n
        mH, mAct = ctx.args[0], ctx.args[1]
        dt = mH.element_type
        col0 = ctx.nt * bn
        gH = cute.domain_offset((ctx.start, col0), mH)
        gA = cute.domain_offset((ctx.start, col0 // 2), mAct)
        h_elems = _staging_elems(bm, en)
        a_elems = _staging_elems(bm, en // 2)
        for j in ctx.sub_tiles():
            base = (j % 2) * (h_elems + a_elems)
            sH = _staging(ctx.sEpi, base, bm, en, dt)
            sA = _staging(ctx.sEpi, base + h_elems, bm, en // 2, dt)
            for i, r, c in ctx.pairs(j):
                gate = ctx.acc[i].to(dt)
                up = ctx.acc[i + 1].to(dt)
                sH[r, c] = gate
                sH[r, c + 1] = up
                g = gate.to(Float32)
                sA[r, c // 2] = (g * _sigmoid(g) * up.to(Float32)).to(dt)
            ctx.barrier.arrive_and_wait()
            _copy_out(ctx, sH, cute.domain_offset((0, j * en), gH), ctx.length, mH.shape[1] - col0 - j * en)
            _copy_out(ctx, sA, cute.domain_offset((0, j * en // 2), gA), ctx.length,
                      mAct.shape[1] - col0 // 2 - j * en // 2)


class DirectSwiGLUEpilogue(_FromRegisters, SwiGLUEpilogue):
    """SwiGLUEpilogue's H and A stored from registers, as DirectStoreEpilogue stores C (needs tile_n % 64 == 0).

    H: each 4 blocks of 8 columns, one quad transpose, as C. A: a register pair (gate, up) makes one A value, so a
    lane holds A column 4 nb + q of each block nb; pairing blocks 2k, 2k + 1 into word k over 8 blocks, a quad
    transpose gives lane q A columns 8q + m (low halves) and 8q + 4 + m (high halves) of the 32 those blocks
    cover, which one permutation of halves puts in order for a 16-byte store. A is computed from the
    bf16-rounded H, exactly as SwiGLUEpilogue (and the backward) computes it."""

    @cute.jit
    def apply(self, ctx):
        bn = ctx.spec.tile_n
        assert bn % 64 == 0, "A's transpose takes 8 blocks of 8 H columns at a time"
        mH, mAct = ctx.args[0], ctx.args[1]
        dt = mH.element_type
        col0 = ctx.nt * bn
        gH = cute.domain_offset((ctx.start, col0), mH)
        gA = cute.domain_offset((ctx.start, col0 // 2), mAct)
        h_valid = mH.shape[1] - col0
        a_valid = mAct.shape[1] - col0 // 2
        q = cute.arch.lane_idx() % 4
        lo = Uint32(0xFFFF)
        hi = Uint32(0xFFFF0000)
        for i0, row in ctx.rows():
            ok = row < ctx.length
            for g in cutlass.range_constexpr(bn // 64):
                h_words, a_vals = [], []
                for k in cutlass.range_constexpr(8):
                    nb = 8 * g + k
                    gate = ctx.acc[i0 + 4 * nb].to(dt)
                    up = ctx.acc[i0 + 4 * nb + 1].to(dt)
                    h_words.append(_pack(gate, up, dt))
                    gf = gate.to(Float32)
                    a_vals.append(gf * _sigmoid(gf) * up.to(Float32))
                for half in cutlass.range_constexpr(2):  # H blocks 8g + 4 half + (0..3)
                    m = _quad_transpose(h_words[4 * half:4 * half + 4], q)
                    col = 8 * (8 * g + 4 * half + q)
                    if ok and col < h_valid:
                        _store16(gH, row, col, m, dt)
                t = _quad_transpose([_pack(a_vals[2 * k], a_vals[2 * k + 1], dt) for k in range(4)], q)
                words = [(t[0] & lo) | (t[1] << 16), (t[2] & lo) | (t[3] << 16),
                         (t[0] >> 16) | (t[1] & hi), (t[2] >> 16) | (t[3] & hi)]
                col = 32 * g + 8 * q
                if ok and col < a_valid:
                    _store16(gA, row, col, words, dt)


class DSwiGLUEpilogue:
    """dH kernel epilogue. The accumulator is dA' = dO[pi] W2 for columns of N.

    With H loaded tile-wise (each thread reads the 4 bf16 of H behind its 2 columns),
    A = silu(gate) * up is recomputed and
      dS    = <dA', A>             row-reduced here, one partial per n-tile (summed by the host)
      dA    = s * dA'
      dH    = dSwiGLU(dA, H)       stored interleaved like H
      A'    = s * A                stored for the dW2 GEMM
    args = (mH (R, 2N), mS (R,) fp32, mDH (R, 2N), mAp (R, N), mDS (n_tiles, R) fp32).
    """

    def smem_elems(self, spec) -> int:
        return 2 * (_staging_elems(spec.tile_m, 2 * spec.epi_n) + _staging_elems(spec.tile_m, spec.epi_n))

    @cute.jit
    def apply(self, ctx):
        spec = ctx.spec
        bm, bn, en = spec.tile_m, spec.tile_n, spec.epi_n
        mH, mS, mDH, mAp, mDS = ctx.args
        dt = mDH.element_type
        col0 = ctx.nt * bn
        gH, gDH, gAp = _dh_tile_views(ctx, col0)
        last = ctx.length - 1
        rows = [row for _, row in ctx.rows()]  # slot q = 2 * mm + v1 holds the row of registers (v1, mm)
        score, ds = _row_scores(ctx, mS, rows, last)
        dh_elems = _staging_elems(bm, 2 * en)
        ap_elems = _staging_elems(bm, en)

        def load_h(j):
            """Issue the H loads of sub-tile j (the 4 values behind each register pair)."""
            regs = []
            for i, r, c in ctx.pairs(j):
                regs.append(_load_h4(mH, gH, r, last, col0, col0 + j * en + c))
            return regs

        h_next = load_h(0)
        for j in ctx.sub_tiles():
            h_cur = h_next
            if const_expr(j + 1 < bn // en):
                h_next = load_h(j + 1)  # in flight while sub-tile j is computed and stored
            base = (j % 2) * (dh_elems + ap_elems)
            sDH = _staging(ctx.sEpi, base, bm, 2 * en, dt)
            sAp = _staging(ctx.sEpi, base + dh_elems, bm, en, dt)
            for p_, (i, r, c) in enumerate(ctx.pairs(j)):
                q = 2 * (i // (bn // 2)) + (i // 2) % 2
                h = h_cur[p_]
                for k in cutlass.range_constexpr(2):
                    a, dgate, dup = _dswiglu(h, k, ctx.acc[i + k], score, ds, q)
                    sDH[r, 2 * (c + k)] = dgate.to(dt)
                    sDH[r, 2 * (c + k) + 1] = dup.to(dt)
                    sAp[r, c + k] = (score[q] * a).to(dt)
            ctx.barrier.arrive_and_wait()
            _copy_out(ctx, sDH, cute.domain_offset((0, 2 * j * en), gDH), ctx.length,
                      mDH.shape[1] - 2 * (col0 + j * en))
            _copy_out(ctx, sAp, cute.domain_offset((0, j * en), gAp), ctx.length,
                      mAp.shape[1] - col0 - j * en)
        _store_ds(ctx, mDS, ds, rows)


class DirectDSwiGLUEpilogue(_FromRegisters, DSwiGLUEpilogue):
    """DSwiGLUEpilogue's dH and A' stored from registers, as DirectStoreEpilogue stores C (needs tile_n % 32 == 0);
    same args, same values, same dS partials.

    Per group of 4 blocks of 8 accumulator columns: a register pair (columns c, c + 1) makes 4 dH columns
    (2c .. 2c + 3: gate/up of c, then of c + 1) and 2 A' columns. Packing the first two dH values of each pair into
    one word and the last two into another, two quad transposes give lane q all 16 dH columns of block 4g + q (two
    16-byte stores), and one more gives it A''s 8 columns of that block, as C's. H for the next group is loaded while
    this one is computed and stored. The staging tiles' shared memory (64 KiB for a ping-pong pp128) goes to the
    ring's stages instead."""

    @cute.jit
    def apply(self, ctx):
        bn = ctx.spec.tile_n
        assert bn % 32 == 0, "the quad transposes take 4 blocks of 8 columns at a time"
        mH, mS, mDH, mAp, mDS = ctx.args
        dt = mDH.element_type
        col0 = ctx.nt * bn
        gH, gDH, gAp = _dh_tile_views(ctx, col0)
        dh_valid = mDH.shape[1] - 2 * col0
        ap_valid = mAp.shape[1] - col0
        last = ctx.length - 1
        q = cute.arch.lane_idx() % 4
        rows = list(ctx.rows())  # slot s = 2 * mm + v1, as DSwiGLUEpilogue numbers them
        slots = len(rows)
        score, ds = _row_scores(ctx, mS, [row for _, row in rows], last)

        def load_h(g):
            """The H values behind each of this thread's pairs in blocks 4g .. 4g + 3, per slot."""
            regs = []
            for i0, row in rows:
                for k in cutlass.range_constexpr(4):
                    regs.append(_load_h4(mH, gH, row, last, col0, col0 + 8 * (4 * g + k) + 2 * q))
            return regs

        h_next = load_h(0)
        for g in cutlass.range_constexpr(bn // 32):
            h_cur = h_next
            if const_expr(g + 1 < bn // 32):
                h_next = load_h(g + 1)  # in flight while group g is computed and stored
            for s in cutlass.range_constexpr(slots):
                i0, row = rows[s]
                lo_words, hi_words, ap_words = [], [], []
                for k in cutlass.range_constexpr(4):
                    h = h_cur[4 * s + k]
                    dh_vals, ap_vals = [], []
                    for e in cutlass.range_constexpr(2):
                        a, dgate, dup = _dswiglu(h, e, ctx.acc[i0 + 4 * (4 * g + k) + e], score, ds, s)
                        dh_vals.append((dgate, dup))
                        ap_vals.append(score[s] * a)
                    lo_words.append(_pack(dh_vals[0][0], dh_vals[0][1], dt))
                    hi_words.append(_pack(dh_vals[1][0], dh_vals[1][1], dt))
                    ap_words.append(_pack(ap_vals[0], ap_vals[1], dt))
                lo = _quad_transpose(lo_words, q)  # lo[l]: dH columns 4l, 4l + 1 of block 4g + q
                hi = _quad_transpose(hi_words, q)  # hi[l]: dH columns 4l + 2, 4l + 3
                ap = _quad_transpose(ap_words, q)
                ok = row < ctx.length
                dcol = 16 * (4 * g + q)
                if ok and dcol < dh_valid:
                    _store16(gDH, row, dcol, [lo[0], hi[0], lo[1], hi[1]], dt)
                if ok and dcol + 8 < dh_valid:
                    _store16(gDH, row, dcol + 8, [lo[2], hi[2], lo[3], hi[3]], dt)
                acol = 8 * (4 * g + q)
                if ok and acol < ap_valid:
                    _store16(gAp, row, acol, ap, dt)
        _store_ds(ctx, mDS, ds, [row for _, row in rows])


def _dh_tile_views(ctx, col0):
    """H, dH and A' from this tile's first row and column on (H and dH hold 2 columns per accumulator column)."""
    mH, _, mDH, mAp, _ = ctx.args
    return (cute.domain_offset((ctx.start, 2 * col0), mH), cute.domain_offset((ctx.start, 2 * col0), mDH),
            cute.domain_offset((ctx.start, col0), mAp))


def _row_scores(ctx, mS: cute.Tensor, rows: list, last):
    """Per slot (one of this thread's fragment rows): its routing score (a row past the expert's end reads the last
    valid one; its results are never stored) and a zeroed dS accumulator. A plain helper, traced inline."""
    score = cute.make_rmem_tensor((len(rows),), Float32)
    ds = cute.make_rmem_tensor((len(rows),), Float32)
    for q in range(len(rows)):  # unrolls as Python
        score[q] = mS[ctx.start + cutlass.min(rows[q], last)]
        ds[q] = Float32(0.0)
    return score, ds


def _load_h4(mH: cute.Tensor, gH: cute.Tensor, row, last, col0, col) -> cute.Tensor:
    """The 4 H values (gate, up of columns col and col + 1; gH starts at the tile's column col0) behind a register
    pair, in one 8-byte load, clamped to a valid row and column group: those values only feed masked stores. A plain
    helper, traced inline."""
    hcol = cutlass.min(2 * col, mH.shape[1] - 4) - 2 * col0
    src = _aligned(cute.local_tile(gH[cutlass.min(row, last), None], (4,), (hcol // 4,)), 8)
    h = cute.make_rmem_tensor((4,), mH.element_type)
    cute.autovec_copy(src, h)
    return h


def _dswiglu(h: cute.Tensor, e: int, da_prime, score: cute.Tensor, ds: cute.Tensor, q: int):
    """Column e of a register pair, from the 4 H values behind the pair: A = silu(gate) * up and dH's (d gate, d up)
    in fp32, with dA' * A added to the row's dS (slot q). A plain helper, traced inline."""
    gate = h[2 * e].to(Float32)
    up = h[2 * e + 1].to(Float32)
    sig = _sigmoid(gate)
    silu = gate * sig
    a = silu * up
    ds[q] += da_prime * a
    da = score[q] * da_prime
    return a, da * up * (sig + silu * (1.0 - sig)), da * silu


@cute.jit
def _store_ds(ctx, mDS: cute.Tensor, ds: cute.Tensor, rows: list):
    """dS = <dA', A> per fragment row: the four lanes of a quad share a row, so reduce over the quad, then one lane
    writes the tile's partial."""
    lane = cute.arch.lane_idx()
    for q in cutlass.range_constexpr(len(rows)):
        v = ds[q]
        v += cute.arch.shuffle_sync_bfly(v, 1)
        v += cute.arch.shuffle_sync_bfly(v, 2)
        if lane % 4 == 0 and rows[q] < ctx.length:
            mDS[ctx.nt, ctx.start + rows[q]] = v
