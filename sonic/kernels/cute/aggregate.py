"""Per-token gather-sum in CuTe DSL: out_t = sum over token t's rows of (w_r *) rows_r.

This is the aggregation of the forward (O from Y and the scores) and of the backward
(dX from dX~). One warp owns one token's slice of columns: each lane keeps 8-column fp32
accumulators for its 16-byte chunks of the slice, walks the token's rows in `rows_by_token`
order (deterministic, no atomics) and stores bf16 once. It is bandwidth-bound: R*D reads
and T*D writes. Rows can be split into column slices over the grid's second dimension, so that
a lane holds at most `max_per_lane` chunks; `default_max_per_lane` says when that pays.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from sonic.kernels.cute.epilogue import _aligned

WARPS = 4


def default_max_per_lane(D: int, weighted: bool) -> int:
    """16-byte chunks per lane and column slice, by measurement (H200, `python -m bench.gather_sum`,
    bench/results/2026-11-25-h200-gather_sum.json: the fastest at the 7B, 30B, OLMoE and 1.4B shapes alike).
    Narrow slices mean few registers and many warps per SM, which hide the latency of the row-index load
    that every row waits on (d = 4096: whole rows 0.79 / 1.33 ms, these 0.57 / 0.61). The weighted sum also
    waits on the score, and does best with a little more work per lane."""
    return 4 if weighted else 2


class GatherSum:
    def __init__(self, D: int, weighted: bool, max_per_lane: int):
        assert D % 8 == 0 and max_per_lane >= 1
        self.D = D
        self.weighted = weighted
        self.chunks = D // 8
        self.slices = -(-self.chunks // (32 * max_per_lane))
        self.per_lane = -(-self.chunks // (32 * self.slices))  # balanced: 192 chunks -> 2 slices of 3 per lane

    @cute.jit
    def __call__(self, mRows: cute.Tensor, mW: cute.Tensor, mTokOff: cute.Tensor,
                 mRowsByTok: cute.Tensor, mOut: cute.Tensor, stream):
        T = mOut.shape[0]
        self.kernel(mRows, mW, mTokOff, mRowsByTok, mOut).launch(
            grid=((T + WARPS - 1) // WARPS, self.slices, 1), block=(32 * WARPS, 1, 1), stream=stream)

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
            for j in cutlass.range(mTokOff[t], mTokOff[t + 1], unroll=1):
                r = mRowsByTok[j]
                w = Float32(1.0)
                if const_expr(self.weighted):
                    w = mW[r].to(Float32)
                for q in cutlass.range_constexpr(self.per_lane):
                    ch = first + lane + 32 * q
                    if ch < self.chunks:
                        src = _aligned(cute.local_tile(mRows[r, None], (8,), (ch,)), 16)
                        v = src.load().to(Float32)
                        for e in cutlass.range_constexpr(8):
                            acc[q, e] += w * v[e]
            for q in cutlass.range_constexpr(self.per_lane):
                ch = first + lane + 32 * q
                if ch < self.chunks:
                    out = cute.make_rmem_tensor((8,), mOut.element_type)
                    for e in cutlass.range_constexpr(8):
                        out[e] = acc[q, e].to(mOut.element_type)
                    dst = _aligned(cute.local_tile(mOut[t, None], (8,), (ch,)), 16)
                    cute.autovec_copy(out, dst)
