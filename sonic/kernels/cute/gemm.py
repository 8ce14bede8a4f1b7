"""One persistent grouped GEMM for Hopper (sm_90a), written in CuTe DSL.

Every SonicMoE matrix product is this kernel with a different operand source and epilogue:

| use             | varlen | A operand                | B operand             | epilogue          |
|-----------------|--------|--------------------------|-----------------------|-------------------|
| up-projection   | M      | X rows gathered (cp.async)| W1_e (TMA)           | SwiGLU: H and A   |
| down-projection | M      | A (TMA)                  | W2_e (TMA)            | store Y           |
| dH              | M      | dO rows gathered         | W2_e, N-major (TMA)   | dSwiGLU, A', dS   |
| dX~             | M      | dH (TMA)                 | W1_e, N-major (TMA)   | store dX~         |
| dW1             | K      | dH^T (TMA)               | X^T gathered          | store dW1_e       |
| dW2             | K      | dO^T gathered            | A'^T (TMA)            | store dW2_e       |

Structure (one CTA per SM, 3 warpgroups):
  * warpgroup 0 is the producer: warp 0 issues the TMA loads; with a gathered operand all four
    warps issue 16-byte cp.async row gathers and signal the same mbarrier (arrive.noinc).
  * warpgroups 1 and 2 are consumers: each owns 64 rows of the 128-row tile (128 rows of a
    256-row one), runs wgmma out of the multi-stage shared-memory ring and then the epilogue.
  * the tile scheduler is static and persistent: CTA b takes linear tiles b, b+grid, ...
    For varlen-M the (expert, m-tile) of a linear tile comes from a per-CTA table in shared
    memory, built at kernel start from the device expert offsets: no host sync, and
    nothing in the compiled kernel depends on the routed-row count.

Tile shapes, stage counts and register splits are chosen in `GemmSpec`; see README.md.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

SMEM_CAPACITY = 232448  # sm_90: 227 KiB per CTA
NUM_THREADS = 384  # producer warpgroup + 2 consumer warpgroups
CONSUMER_THREADS = 256


@dataclass(frozen=True)
class GemmSpec:
    """Static configuration of one compiled grouped GEMM (part of the compile-cache key)."""

    varlen: str  # "m": rows of A/C are segmented by expert; "k": the reduction dim is
    gather: Optional[str]  # None, "a" or "b": which operand's rows go through the index
    num_experts: int
    tile_n: int = 256
    tile_m: int = 128
    tile_k: int = 64
    epi_n: int = 32  # epilogue sub-tile width (columns of the accumulator)
    pingpong: bool = False  # consumers take alternate tiles; one's epilogue hides under the other's MMAs
    # CTAs per cluster along N: a pair takes adjacent n-tiles of one m-tile, and each loads half of their
    # shared A tile and multicasts it to both (half the A traffic from L2). varlen-M, TMA operands only.
    cluster_n: int = 1
    num_sms: int = 132

    def __post_init__(self):
        assert self.varlen in ("m", "k")
        assert self.gather in (None, "a", "b")
        assert not (self.varlen == "m" and self.gather == "b")
        assert self.tile_m in (128, 256) and self.tile_k == 64
        assert self.epi_n in (16, 32) and self.tile_n % self.epi_n == 0
        # a ping-pong consumer holds a whole tile: 128 x tile_n fp32 over 128 threads (192 registers at most)
        assert not self.pingpong or self.tile_n <= 192
        # 256 rows: each cooperative warpgroup owns 128 of them; the row gather of 8 rows per thread assumes 128
        assert self.tile_m == 128 or (not self.pingpong and self.gather != "a")
        assert self.cluster_n in (1, 2)
        assert self.cluster_n == 1 or (self.varlen == "m" and self.gather is None), "multicast needs TMA-loaded A"

    @property
    def epi_threads(self) -> int:
        """Threads that run one tile's epilogue: one warpgroup (ping-pong) or both."""
        return 128 if self.pingpong else CONSUMER_THREADS


@dataclass(frozen=True)
class _PipelineTmaCpAsync(pipeline.PipelineTmaAsync):
    """TMA + cp.async producers, wgmma consumers.

    The full barrier of a stage expects one arrive (with the TMA byte count) from the TMA warp
    plus one cp.async.mbarrier.arrive.noinc from each gathering thread, so the stage turns
    full only when the bulk copy and every row gather have landed.
    """

    @staticmethod
    def create(**kwargs):
        base = pipeline.PipelineTmaAsync.create(**kwargs)
        return _PipelineTmaCpAsync(*[getattr(base, f.name) for f in dataclasses.fields(base)])

    @cute.jit
    def producer_acquire_split(self, state, is_tma_warp):
        self.sync_object_empty.wait(state.index, state.phase)
        if is_tma_warp:
            self.sync_object_full.arrive(state.index, self.producer_mask)

    def producer_cpasync_arrive(self, state):
        cute.arch.cp_async_mbarrier_arrive_noinc(self.producer_get_barrier(state))


class GroupedGemm:
    """C[rows, n] = sum_k A[rows, k] B[n, k] per expert, with a pluggable epilogue.

    `epilogue` is an object with `smem_elems(spec)` (bf16 staging it needs) and a device
    method `apply(ctx)`; see sonic/kernels/cute/epilogue.py.
    """

    def __init__(self, spec: GemmSpec, epilogue):
        self.spec = spec
        self.epi = epilogue
        self.bm, self.bn, self.bk = spec.tile_m, spec.tile_n, spec.tile_k
        self.num_gather_threads = 128 if spec.gather else 0
        self.regs_producer, self.regs_consumer = (40, 232)
        if spec.gather:  # index registers: 8 rows (varlen-M) or 2 x 8-16 k-rows (varlen-K)
            self.regs_producer, self.regs_consumer = (72, 216) if spec.varlen == "k" else (56, 224)
        # named barriers: 1, 2 = epilogue of consumer 0 / 1 (cooperative: 1 for both);
        # 3, 4 = ping-pong turn of consumer 0 / 1 (one warpgroup arrives, the other waits)
        self.epi_copies = 2 if spec.pingpong else 1  # each ping-pong consumer stages its own tiles

    # ------------------------------------------------------------------ host-side setup
    def _stages(self, epi_bytes: int) -> int:
        stage_bytes = (self.bm + self.bn) * self.bk * 2
        tables = 2 * 4 * (self.spec.num_experts + 1) + 1024
        stages = (SMEM_CAPACITY - epi_bytes - tables - 2048) // stage_bytes
        assert stages >= 2, "tile too large for shared memory"
        return min(stages, 8)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mOffsets: cute.Tensor, mIdx: cute.Tensor,
                 epi_args: tuple, stream):
        """mA (M, K) or (K-view) and mB (N, K, E) in GEMM orientation; see ops.py for the views."""
        self.a_dtype = mA.element_type
        self.b_dtype = mB.element_type
        self.a_layout = LayoutEnum.from_tensor(mA)
        self.k_even = const_expr(self.spec.varlen == "k" or mA.shape[1] % self.bk == 0)
        self.b_layout = LayoutEnum.from_tensor(mB)
        tile_mnk = (self.bm, self.bn, self.bk)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(), cutlass.Float32,
            (1, 1, 1) if const_expr(self.spec.pingpong) else (2, 1, 1), tiler_mn=(64, self.bn))
        epi_elems = self.epi.smem_elems(self.spec) * self.epi_copies
        self.stages = self._stages(epi_elems * 2)
        a_smem = sm90_utils.make_smem_layout_a(self.a_layout, tile_mnk, self.a_dtype, self.stages)
        b_smem = sm90_utils.make_smem_layout_b(self.b_layout, tile_mnk, self.b_dtype, self.stages)
        a_one = cute.slice_(a_smem, (None, None, 0))
        b_one = cute.slice_(b_smem, (None, None, 0))

        tma_a, tma_b = None, None
        mA_tma, mB_tma = mA, mB
        tma_bytes = 0
        if const_expr(self.spec.gather != "a"):
            op = cpasync.CopyBulkTensorTileG2SOp() if self.spec.cluster_n == 1 else \
                cpasync.CopyBulkTensorTileG2SMulticastOp()
            tma_a, mA_tma = cpasync.make_tiled_tma_atom(op, mA, a_one, (self.bm, self.bk),
                                                        num_multicast=self.spec.cluster_n)
            tma_bytes += cute.size_in_bytes(self.a_dtype, a_one)
        if const_expr(self.spec.gather != "b"):
            tma_b, mB_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mB, b_one, (self.bn, self.bk))
            tma_bytes += cute.size_in_bytes(self.b_dtype, b_one)
        self.tma_bytes = tma_bytes

        E = self.spec.num_experts

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            tile_start: cute.struct.MemRange[Int32, E + 1]
            row_start: cute.struct.MemRange[Int32, E + 1]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(b_smem)], 1024]
            sEpi: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, epi_elems], 128]

        self.shared_storage = SharedStorage
        if const_expr(self.spec.varlen == "m"):
            grid = self.spec.num_sms  # tile count is only known on device
            grid -= grid % self.spec.cluster_n  # whole clusters
        else:
            n_tiles = E * cute.ceil_div(mA.shape[0], self.bm) * cute.ceil_div(mB.shape[0], self.bn)
            grid = min(self.spec.num_sms, n_tiles)
        self.kernel(tma_a, mA_tma, tma_b, mB_tma, mA, mB, mOffsets, mIdx, epi_args,
                    self.tiled_mma, a_smem, b_smem).launch(
            grid=(grid, 1, 1), block=(NUM_THREADS, 1, 1), min_blocks_per_mp=1, stream=stream,
            # no cluster attribute at all without one: the launch stays exactly the plain one
            cluster=(self.spec.cluster_n, 1, 1) if self.spec.cluster_n > 1 else None)

    # ------------------------------------------------------------------ device code
    @cute.kernel
    def kernel(self, tma_a: Optional[cute.CopyAtom], mA_tma: cute.Tensor,
               tma_b: Optional[cute.CopyAtom], mB_tma: cute.Tensor, mA: cute.Tensor,
               mB: cute.Tensor, mOffsets: cute.Tensor, mIdx: cute.Tensor, epi_args: tuple,
               tiled_mma: cute.TiledMma, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4
        E = self.spec.num_experts
        if warp_idx == 0:
            if const_expr(tma_a is not None):
                cpasync.prefetch_descriptor(tma_a)
            if const_expr(tma_b is not None):
                cpasync.prefetch_descriptor(tma_b)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        producer_arrivals = 1 + self.num_gather_threads
        cluster = self.spec.cluster_n
        pipe_cls = _PipelineTmaCpAsync if const_expr(self.spec.gather is not None) else pipeline.PipelineTmaAsync
        ab_pipe = pipe_cls.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producer_arrivals),
            # one arrive per consumer warp that reads a stage, 4 (ping-pong) or 8 (cooperative), from each CTA
            # of the cluster: a stage is free only once both CTAs have read the A half this one multicast
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.spec.epi_threads // 32 * cluster),
            tx_count=self.tma_bytes, cta_layout_vmnk=cute.make_layout((1, 1, cluster, 1)), defer_sync=True)
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sEpi = storage.sEpi.get_tensor(cute.make_layout(self.epi.smem_elems(self.spec) * self.epi_copies))
        sTile = storage.tile_start.get_tensor(cute.make_layout(E + 1))
        sRow = storage.row_start.get_tensor(cute.make_layout(E + 1))
        if const_expr(self.spec.varlen == "m"):
            if warp_idx == 1:
                self._build_tables(mOffsets, sTile, sRow)
        cute.arch.mbarrier_init_fence()
        if const_expr(cluster > 1):  # the peer's barriers are initialised before anything arrives on them
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        n_tiles_n = cute.ceil_div(mB.shape[0], self.bn)
        if const_expr(cluster > 1):
            # an even count keeps a cluster's CTAs (consecutive block ids, an even grid) on the two n-tiles of
            # one m-tile; an n-tile past N loads zeros (TMA bounds) and stores nothing
            n_tiles_n = (n_tiles_n + 1) // 2 * 2
        if const_expr(self.spec.varlen == "m"):
            total = sTile[E] * n_tiles_n
        else:
            total = E * cute.ceil_div(mA.shape[0], self.bm) * n_tiles_n
        grid = cute.arch.grid_dim()[0]
        bid = cute.arch.block_idx()[0]

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            if const_expr(self.spec.gather is not None):
                self._producer(ab_pipe, tma_a, mA_tma, tma_b, mB_tma, mA, mB, mIdx, sA, sB,
                               sTile, sRow, mOffsets, bid, grid, total, n_tiles_n, warp_idx)
            else:
                if warp_idx == 0:
                    self._producer(ab_pipe, tma_a, mA_tma, tma_b, mB_tma, mA, mB, mIdx, sA, sB,
                                   sTile, sRow, mOffsets, bid, grid, total, n_tiles_n, warp_idx)
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            self._consumer(ab_pipe, tiled_mma, sA, sB, sEpi, sTile, sRow, mOffsets, mA, mB,
                           epi_args, bid, grid, total, n_tiles_n, tidx - 128, wg_idx - 1)

    @cute.jit
    def _build_tables(self, mOffsets: cute.Tensor, sTile: cute.Tensor, sRow: cute.Tensor):
        """One warp: tile_start[e] = sum_{e'<e} ceil(count_e' / tile_m), row_start[e] = offsets[e]."""
        E = self.spec.num_experts
        per_lane = (E + 31) // 32
        lane = cute.arch.lane_idx()
        counts = cute.make_rmem_tensor((per_lane,), Int32)
        local = Int32(0)
        for j in cutlass.range_constexpr(per_lane):
            e = lane * per_lane + j
            c = Int32(0)
            if e < E:
                lo = mOffsets[e]
                c = (mOffsets[e + 1] - lo + self.bm - 1) // self.bm
                sRow[e] = lo
            counts[j] = c
            local += c
        incl = local
        for s in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(incl, 1 << s)
            if lane >= (1 << s):
                incl += other
        run = incl - local
        for j in cutlass.range_constexpr(per_lane):
            e = lane * per_lane + j
            if e < E:
                sTile[e] = run
            run += counts[j]
        if lane == 31:
            sTile[E] = incl
            sRow[E] = mOffsets[E]

    @cute.jit
    def _decode(self, t: Int32, n_tiles_n: Int32, sTile: cute.Tensor, sRow: cute.Tensor,
                mOffsets: cute.Tensor, m_tiles: Int32):
        """Linear tile -> (expert, m_tile, n_tile, first row/k, valid rows/k)."""
        E = self.spec.num_experts
        expert = Int32(0)
        mt = Int32(0)
        nt = Int32(0)
        start = Int32(0)
        length = Int32(0)
        if const_expr(self.spec.varlen == "m"):
            m_lin = t // n_tiles_n
            nt = t - m_lin * n_tiles_n
            lo = Int32(0)
            hi = Int32(E)
            for _ in cutlass.range_constexpr(max(1, math.ceil(math.log2(E + 1)))):
                mid = (lo + hi) // 2
                if sTile[mid] <= m_lin:
                    lo = mid
                else:
                    hi = mid
            expert = lo
            mt = m_lin - sTile[expert]
            start = sRow[expert] + mt * self.bm
            length = cutlass.min(sRow[expert + 1] - start, self.bm)
        else:
            per_e = m_tiles * n_tiles_n
            expert = t // per_e
            rest = t - expert * per_e
            mt = rest // n_tiles_n
            nt = rest - mt * n_tiles_n
            start = mOffsets[expert]
            length = mOffsets[expert + 1] - start
        return expert, mt, nt, start, length

    # ------------------------------------------------------------------ producer
    @cute.jit
    def _producer(self, ab_pipe, tma_a, mA_tma, tma_b, mB_tma, mA, mB, mIdx, sA, sB, sTile, sRow,
                  mOffsets, bid, grid, total, n_tiles_n, warp_idx):
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        m_tiles = cute.ceil_div(mA.shape[0], self.bm)
        k_tiles_static = cute.ceil_div(mA.shape[1], self.bk)
        is_tma_warp = warp_idx == 0
        gtid = cute.arch.thread_idx()[0]  # 0..127 within the producer warpgroup
        rank = Int32(0)
        mcast = None
        if const_expr(self.spec.cluster_n > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            cluster_layout = cute.make_layout((1, self.spec.cluster_n, 1))
            mcast = cute.make_layout_image_mask(cluster_layout, cluster_layout.get_flat_coord(rank), mode=1)
        t = bid
        while t < total:
            expert, mt, nt, start, length = self._decode(t, n_tiles_n, sTile, sRow, mOffsets, m_tiles)
            k_tiles = k_tiles_static
            if const_expr(self.spec.varlen == "k"):
                k_tiles = (length + self.bk - 1) // self.bk
            # --- views of this tile's operands
            tAsA, tAgA, tBsB, tBgB = None, None, None, None
            if const_expr(self.spec.gather != "a"):
                if const_expr(self.spec.varlen == "m"):
                    gA = cute.local_tile(cute.domain_offset((start, 0), mA_tma), (self.bm, self.bk), (0, None))
                else:
                    gA = cute.local_tile(cute.domain_offset((0, start), mA_tma), (self.bm, self.bk), (mt, None))
                # with a cluster, this CTA loads its half of the A tile's rows and multicasts it to both
                tAsA, tAgA = cpasync.tma_partition(tma_a, rank, cute.make_layout(self.spec.cluster_n),
                                                   cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
            if const_expr(self.spec.gather != "b"):
                if const_expr(self.spec.varlen == "m"):
                    gB = cute.local_tile(mB_tma[None, None, expert], (self.bn, self.bk), (nt, None))
                else:
                    gB = cute.local_tile(cute.domain_offset((0, start), mB_tma), (self.bn, self.bk), (nt, None))
                tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                                   cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
            gather_fn, prefetch_fn = None, None
            if const_expr(self.spec.gather == "a"):
                if const_expr(self.spec.varlen == "m"):
                    gather_fn = self._gather_rows_fn(mA, sA, mIdx, start, length, gtid)
                else:
                    prefetch_fn, gather_fn = self._gather_k_fn(mA, sA, mIdx, start, length, mt * self.bm, gtid)
            if const_expr(self.spec.gather == "b"):
                prefetch_fn, gather_fn = self._gather_k_fn(mB, sB, mIdx, start, length, nt * self.bn, gtid)

            ops_ = (tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, gather_fn, is_tma_warp, mcast)
            if const_expr(prefetch_fn is None):
                for kt in cutlass.range(k_tiles, unroll=1):
                    self._load_stage(ab_pipe, state, kt, None, *ops_)
                    state.advance()
            else:
                # varlen-K gathers need a token index per k-row: keep the index loads two
                # k-tiles ahead of the cp.asyncs that use them, so their latency is hidden
                idx0, idx1 = prefetch_fn.alloc(), prefetch_fn.alloc()
                prefetch_fn(0, idx0)
                prefetch_fn(1, idx1)
                for kt2 in cutlass.range(0, k_tiles, 2, unroll=1):
                    self._load_stage(ab_pipe, state, kt2, idx0, *ops_)
                    state.advance()
                    prefetch_fn(kt2 + 2, idx0)
                    if kt2 + 1 < k_tiles:
                        self._load_stage(ab_pipe, state, kt2 + 1, idx1, *ops_)
                        state.advance()
                        prefetch_fn(kt2 + 3, idx1)
            t += grid
        ab_pipe.producer_tail(state)

    @cute.jit
    def _load_stage(self, ab_pipe, state, kt, idx, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, gather_fn,
                    is_tma_warp, mcast):
        """Fill ring stage `state` with k-tile kt (idx: prefetched token rows for varlen-K; mcast: the
        cluster's CTAs that receive this CTA's part of A, None without a cluster)."""
        if const_expr(self.spec.gather is None):
            ab_pipe.producer_acquire(state)
            bar = ab_pipe.producer_get_barrier(state)
            if const_expr(mcast is None):
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
            else:
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar, mcast_mask=mcast)
            cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar)
            ab_pipe.producer_commit(state)
        else:
            ab_pipe.producer_acquire_split(state, is_tma_warp)
            if is_tma_warp:
                bar = ab_pipe.producer_get_barrier(state)
                if const_expr(self.spec.gather == "a"):
                    cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                else:
                    cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
            if const_expr(idx is None):
                gather_fn(kt, state.index)
            else:
                gather_fn(idx, state.index)
            ab_pipe.producer_cpasync_arrive(state)

    def _gather_copy(self, dtype, k_major: bool, mn_extent: int = 128):
        """128 producer threads, 16-byte cp.async, laid out along the contiguous dimension."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                                   num_bits_per_copy=128)
        if const_expr(k_major):
            per_row = self.bk // 8  # threads along K
            thr = cute.make_layout((128 // per_row, per_row), stride=(per_row, 1))
            val = cute.make_layout((1, 8))
        else:
            per_col = mn_extent // 8  # threads along the gathered operand's M or N
            thr = cute.make_layout((per_col, 128 // per_col), stride=(1, per_col))
            val = cute.make_layout((8, 1))
        return cute.make_tiled_copy_tv(atom, thr, val)

    @cute.jit
    def _gather_rows_fn(self, mX: cute.Tensor, sA: cute.Tensor, mIdx: cute.Tensor, start: Int32,
                        length: Int32, gtid: Int32):
        """Varlen-M gathered A (K-major): smem row m of the tile <- X[idx[start + m], k-tile].

        Rows past the expert's end load a valid row (their results are never stored); columns
        past D are zero-filled."""
        tiled = self._gather_copy(mX.element_type, True)
        thr = tiled.get_slice(gtid)
        tAsA = thr.partition_D(sA)  # (CPY, CPY_M, CPY_K, STAGE)
        cA = cute.make_identity_tensor((self.bm, self.bk))
        tAcA = thr.partition_S(cA)
        rows = cute.size(tAcA, mode=[1])
        num_rows = mIdx.shape[0]
        tok = cute.make_rmem_tensor((rows,), Int32)
        for m in cutlass.range_constexpr(rows):
            r = start + tAcA[0, m, 0][0]
            r = cutlass.min(r, num_rows - 1)
            tok[m] = mIdx[r]
        col = tAcA[0, 0, 0][1]
        width = mX.shape[1]

        def copy_fn(kt, stage):
            k0 = kt * self.bk + col
            for m in cutlass.range_constexpr(rows):
                src = cute.local_tile(mX[tok[m], None], (8,), (k0 // 8,))
                dst = tAsA[None, m, 0, stage]
                if const_expr(self.k_even):
                    cute.copy(tiled, src, dst)
                else:
                    pred = cute.make_rmem_tensor(dst.shape, Boolean)
                    pred.fill(k0 < width)
                    cute.copy(tiled, src, dst, pred=pred)

        return copy_fn

    @cute.jit
    def _gather_k_fn(self, mX: cute.Tensor, sX: cute.Tensor, mIdx: cute.Tensor, start: Int32,
                     length: Int32, mn0: Int32, gtid: Int32):
        """Varlen-K gathered operand (MN-major): smem k-row j <- X[idx[start + kt*bk + j], mn0:+tile].

        X is viewed (MN, T). Returns (prefetch, copy): prefetch(kt, regs) loads the token of
        each of this thread's k-rows (-1 past the expert's end); copy(regs, stage) issues the
        cp.asyncs, zero-filling the -1 rows so the contiguous operand's next-expert rows
        contribute nothing."""
        ext = self.bm if const_expr(self.spec.gather == "a") else self.bn
        tiled = self._gather_copy(mX.element_type, False, ext)
        thr = tiled.get_slice(gtid)
        tXsX = thr.partition_D(sX)  # (CPY, CPY_MN, CPY_K, STAGE)
        cX = cute.make_identity_tensor((ext, self.bk))
        tXcX = thr.partition_S(cX)
        kk = cute.size(tXcX, mode=[2])
        mn = mn0 + tXcX[0, 0, 0][0]
        mn_ok = mn < mX.shape[0]
        mn_chunk = cutlass.min(mn, mX.shape[0] - 8) // 8

        class Prefetch:
            def alloc(self):
                return cute.make_rmem_tensor((kk,), Int32)

            def __call__(self, kt, regs):
                for j in cutlass.range_constexpr(kk):
                    krow = kt * self_.bk + tXcX[0, 0, j][1]
                    tok = Int32(-1)
                    if krow < length and mn_ok:
                        tok = mIdx[start + krow]
                    regs[j] = tok

        self_ = self

        def copy_fn(regs, stage):
            for j in cutlass.range_constexpr(kk):
                tok = regs[j]
                src = cute.local_tile(mX[None, cutlass.max(tok, 0)], (8,), (mn_chunk,))
                dst = tXsX[None, 0, j, stage]
                pred = cute.make_rmem_tensor(dst.shape, Boolean)
                pred.fill(tok >= 0)
                cute.copy(tiled, src, dst, pred=pred)

        return Prefetch(), copy_fn

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def _k_tiles(self, t, n_tiles_n, sTile, sRow, mOffsets, m_tiles, k_tiles_static):
        if const_expr(self.spec.varlen == "m"):
            return k_tiles_static
        else:
            _, _, _, _, length = self._decode(t, n_tiles_n, sTile, sRow, mOffsets, m_tiles)
            return (length + self.bk - 1) // self.bk

    @cute.jit
    def _consumer(self, ab_pipe, tiled_mma, sA, sB, sEpi, sTile, sRow, mOffsets, mA, mB, epi_args,
                  bid, grid, total, n_tiles_n, ctid, cwg):
        """Cooperative: both warpgroups share each tile (64 rows each).
        Ping-pong: warpgroup w takes this CTA's tiles w, w+2, ...; the turn barriers let only
        one warpgroup issue wgmma at a time, in tile order, while the other runs its epilogue.
        A warpgroup skips the ring stages of the other's tiles (same order as the producer)."""
        pp = const_expr(self.spec.pingpong)
        etid = ctid - 128 * cwg if pp else ctid  # thread index within the epilogue group
        thr_ab = tiled_mma.get_slice(0 if pp else cwg * 128)
        tCsA = thr_ab.partition_A(sA)
        tCsB = thr_ab.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        cC = cute.make_identity_tensor((self.bm, self.bn))
        tCcC = tiled_mma.get_slice(etid).partition_C(cC)
        acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
        num_k_blocks = cute.size(tCrA, mode=[2])
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        m_tiles = cute.ceil_div(mA.shape[0], self.bm)
        k_tiles_static = cute.ceil_div(mA.shape[1], self.bk)
        epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=CONSUMER_THREADS)
        my_turn, their_turn = None, None
        sEpiMine = sEpi
        t = bid
        step = grid
        if const_expr(pp):
            step = 2 * grid
            epi_elems = self.epi.smem_elems(self.spec)
            sEpiMine = cute.make_tensor(sEpi.iterator + cwg * epi_elems, cute.make_layout(epi_elems))
            epi_barrier = pipeline.NamedBarrier(barrier_id=1 + cwg, num_threads=128)
            my_turn = pipeline.NamedBarrier(barrier_id=3 + cwg, num_threads=CONSUMER_THREADS)
            their_turn = pipeline.NamedBarrier(barrier_id=4 - cwg, num_threads=CONSUMER_THREADS)
            t = bid + cwg * grid
            if cwg == 1 and bid < total:  # the stages of consumer 0's first tile
                n = self._k_tiles(bid, n_tiles_n, sTile, sRow, mOffsets, m_tiles, k_tiles_static)
                read, release = _advanced(read, n), _advanced(release, n)
        while t < total:
            expert, mt, nt, start, length = self._decode(t, n_tiles_n, sTile, sRow, mOffsets, m_tiles)
            k_tiles = k_tiles_static
            if const_expr(self.spec.varlen == "k"):
                k_tiles = (length + self.bk - 1) // self.bk
            if const_expr(pp):
                if cwg == 1 or t != bid:
                    my_turn.arrive_and_wait()  # the other's mainloop is done
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            # keep one wgmma batch in flight: release stage k-1 after issuing stage k
            for kt in cutlass.range(k_tiles, unroll=1):
                ab_pipe.consumer_wait(read)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(num_k_blocks):
                    coord = (None, None, kb, read.index)
                    cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(1)
                if kt > 0:
                    ab_pipe.consumer_release(release)
                    release.advance()
                read.advance()
            if const_expr(pp):
                if t + grid < total:
                    their_turn.arrive()  # the other's turn to issue wgmma
            warpgroup.wait_group(0)
            if k_tiles > 0:
                ab_pipe.consumer_release(release)
                release.advance()
            if const_expr(pp):
                if t + grid < total:  # skip the stages of the other consumer's next tile
                    n = self._k_tiles(t + grid, n_tiles_n, sTile, sRow, mOffsets, m_tiles, k_tiles_static)
                    read, release = _advanced(read, n), _advanced(release, n)
            ctx = EpilogueContext(self, acc, tCcC, sEpiMine, epi_args, expert, mt, nt, start, length,
                                  etid, epi_barrier)
            self.epi.apply(ctx)
            t += step


def _advanced(state: pipeline.PipelineState, n) -> pipeline.PipelineState:
    """`state` advanced by n stages, as a new value (jit callees cannot mutate their caller's
    pipeline state: their arguments are rebuilt from IR values)."""
    stages = state.stages
    index = state.index + n
    return pipeline.PipelineState(stages, state.count + n, index % stages,
                                  state.phase ^ ((index // stages) % 2))


class EpilogueContext:
    """What an epilogue sees: the fp32 accumulator fragment and where this tile lives.

    `pairs(j)` lists, for epilogue sub-tile j, every register pair (i, i+1) of the fragment
    as (i, row, column-within-the-sub-tile); the two registers are adjacent columns."""

    def __init__(self, gemm, acc, tCcC, sEpi, args, expert, mt, nt, start, length, tid, barrier):
        self.gemm, self.spec = gemm, gemm.spec
        self.acc, self.tCcC, self.sEpi, self.args = acc, tCcC, sEpi, args
        self.expert, self.mt, self.nt, self.start, self.length = expert, mt, nt, start, length
        self.tid = tid
        self.nthreads = gemm.spec.epi_threads
        self.barrier = barrier

    def sub_tiles(self):
        """The epilogue sub-tiles j = 0, 1, ... of this tile. Sub-tile j stages into buffer j % 2; with an odd count
        the next tile's sub-tile 0 would restage buffer 0 while slower threads still copy it out, so an odd count
        ends with one more barrier."""
        n = self.spec.tile_n // self.spec.epi_n
        yield from range(n)
        if n % 2:
            self.barrier.arrive_and_wait()

    def rows(self):
        """Each fragment row this thread holds, as (i0, row): its registers are i0 + v0 + 4 * nb (v0 in 0, 1 the
        adjacent columns, nb the 8-column block), as the module docstring of epilogue.py lays them out."""
        bn = self.spec.tile_n
        for mm in range(cute.size(self.acc, mode=[1])):
            for v1 in range(2):
                i0 = 2 * v1 + (bn // 2) * mm
                yield i0, self.tCcC[i0][0]

    def pairs(self, j: int):
        bn, en = self.spec.tile_n, self.spec.epi_n
        for mm in range(cute.size(self.acc, mode=[1])):
            for nb in range(en // 8):
                for v1 in range(2):
                    i = 2 * v1 + 4 * (j * (en // 8) + nb) + (bn // 2) * mm
                    row, col = self.tCcC[i]
                    yield i, row, col - j * en
