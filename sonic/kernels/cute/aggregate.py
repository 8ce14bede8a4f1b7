"""Per-token gather-sum in CuTe DSL: out_t = sum over token t's rows of (w_r *) rows_r.

This is the aggregation of the forward (O from Y and the scores) and of the backward
(dX from dX~). One warp owns one token's slice of columns: each lane keeps 8-column fp32
accumulators for its 16-byte chunks of the slice, walks the token's rows in `rows_by_token`
order (deterministic, no atomics) and stores bf16 once. The warp loads the token's row indices
(and scores) 32 at a time, one per lane, and hands each row's to every lane by a shuffle, so
the row loads of several rows are in flight together rather than each waiting on a load of its
index. It is bandwidth-bound: R*D reads and T*D writes. Rows can be split into column slices
over the grid's second dimension, so that a lane holds at most `max_per_lane` chunks;
`default_max_per_lane` says when that pays.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from sonic.kernels.cute.epilogue import _aligned

WARPS = 4
ROW_UNROLL = 4  # rows of a token in flight at once (top-K gives K of them)


def default_max_per_lane(D: int, weighted: bool) -> int:
    """16-byte chunks per lane and column slice, by measurement (H200, `python -m bench.gather_sum`,
    bench/results/2026-11-25-h200-gather_sum.json: the fastest at the 7B, 30B, OLMoE and 1.4B shapes alike).
    Narrow slices mean few registers and many warps per SM, which hide the rows' load latency (d = 4096: whole
    rows 0.79 / 1.33 ms, these 0.57 / 0.61; measured before the row indices came by shuffle, see the module
    docstring). The weighted sum also waited on the score, and did best with a little more work per lane."""
    return 4 if weighted else 2


class GatherSum:
    def __init__(self, D: int, weighted: bool, max_per_lane: int):
        assert D % 8 == 0 and max_per_lane >= 1
        self.D = D
        self.weighted = weighted
        self.chunks = D // 8
        self.slices = -(-self.chunks // (32 * max_per_lane))
        self.per_lane = -(-self.chunks // (32 * self.slices))  # balanced: 192 chunks -> 2 slices of 3 per lane
        self.exact = self.slices * 32 * self.per_lane == self.chunks  # every lane's every chunk is in the row

    @cute.jit
    def __call__(self, mRows: cute.Tensor, mW: cute.Tensor, mTokOff: cute.Tensor,
                 mRowsByTok: cute.Tensor, mOut: cute.Tensor, stream):
        T = mOut.shape[0]
        self.kernel(mRows, mW, mTokOff, mRowsByTok, mOut).launch(
            grid=((T + WARPS - 1) // WARPS, self.slices, 1), block=(32 * WARPS, 1, 1), stream=stream)

    @cute.jit
    def add_chunk(self, acc: cute.Tensor, q: cutlass.Constexpr, mRows: cute.Tensor, r: Int32, ch: Int32, w: Float32):
        """acc[q] += w * the row r's 16-byte chunk ch, in fp32."""
        v = _aligned(cute.local_tile(mRows[r, None], (8,), (ch,)), 16).load().to(Float32)
        for e in cutlass.range_constexpr(8):
            acc[q, e] += w * v[e]

    @cute.kernel
    def kernel(self, mRows: cute.Tensor, mW: cute.Tensor, mTokOff: cute.Tensor,
               mRowsByTok: cute.Tensor, mOut: cute.Tensor):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        t = cute.arch.block_idx()[0] * WARPS + warp
        first = cute.arch.block_idx()[1] * (32 * self.per_lane)  # this slice's first chunk
        if t < mOut.shape[0]:
            acc = cute.make_rmem_tensor((self.per_lane, 8), Float32)
            acc.fill(0.0)
            end = mTokOff[t + 1]
            for j0 in cutlass.range(mTokOff[t], end, 32, unroll=1):
                # lane i loads the index (and score) of the token's row j0 + i up front; the rows below then get
                # theirs by a shuffle, not by a load each waits on
                mine = j0 + lane
                my_r = Int32(0)
                my_w = Float32(1.0)
                if mine < end:
                    my_r = mRowsByTok[mine]
                    if const_expr(self.weighted):
                        my_w = mW[my_r].to(Float32)
                count = end - j0
                if count > 32:
                    count = Int32(32)
                for i in cutlass.range(count, unroll=ROW_UNROLL):
                    r = cute.arch.shuffle_sync(my_r, i)
                    w = Float32(1.0)
                    if const_expr(self.weighted):
                        w = cute.arch.shuffle_sync(my_w, i)
                    for q in cutlass.range_constexpr(self.per_lane):
                        ch = first + lane + 32 * q
                        if const_expr(self.exact):  # no bound to test: the row's loads need no branch around them
                            self.add_chunk(acc, q, mRows, r, ch, w)
                        elif ch < self.chunks:
                            self.add_chunk(acc, q, mRows, r, ch, w)
            for q in cutlass.range_constexpr(self.per_lane):
                ch = first + lane + 32 * q
                if ch < self.chunks:
                    out = cute.make_rmem_tensor((8,), mOut.element_type)
                    for e in cutlass.range_constexpr(8):
                        out[e] = acc[q, e].to(mOut.element_type)
                    dst = _aligned(cute.local_tile(mOut[t, None], (8,), (ch,)), 16)
                    cute.autovec_copy(out, dst)
