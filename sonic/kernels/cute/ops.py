"""Host side of the CuTe kernels: tensor views, compilation cache, launches.

Kernels are compiled against symbolic ("fake") tensors in which the token count T and the
routed-row count R are runtime values; D, N, E, the dtype and the tile configuration are
static. The in-process cache is keyed by exactly that shape class, so a new batch with a
different routing never recompiles. Calls go through TVM-FFI (torch tensors in, the
current torch stream implied), which keeps the per-launch host cost to a few microseconds.

Compiled kernels are also exported as object files to a disk cache (SONIC_CUTE_CACHE_DIR,
default ~/.cache/sonic/cute; "off" disables it), keyed by the shape class, the GPU's SM
count, the DSL version and a hash of this package's kernel sources; a later process loads
them in ~0.1 s instead of compiling (1-3 s each).
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
import time
import warnings
from dataclasses import dataclass, replace

import torch
from torch import Tensor

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor
from cutlass.runtime import make_fake_stream

from sonic.kernels.cute.aggregate import GatherSum, default_max_per_lane
from sonic.kernels.cute.epilogue import (DirectDSwiGLUEpilogue, DirectStoreEpilogue, DirectSwiGLUEpilogue,
                                         DSwiGLUEpilogue, StoreEpilogue, SwiGLUEpilogue)
from sonic.kernels.cute.gemm import GemmSpec, GroupedGemm

_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
_LOCK = threading.Lock()
COMPILE_LOG: list[tuple[str, float]] = []  # (kernel key, seconds), for benchmarks and tests


_MODULES: list = []  # loaded object files stay alive as long as their functions
_SOURCES = ("gemm.py", "epilogue.py", "aggregate.py", "ops.py")


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    h = hashlib.sha256(cutlass.__version__.encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in _SOURCES:
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _cache_dir() -> str | None:
    d = os.environ.get("SONIC_CUTE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "sonic", "cute"))
    return None if d.lower() in ("", "0", "off", "none") else d


def _compile_cached(key: str, compile_fn):
    """compile_fn() through the disk cache: load the exported object file if present, else
    compile and export it (atomically, so concurrent processes never read half a file)."""
    t0 = time.perf_counter()
    d = _cache_dir()
    name = "sonic_" + re.sub(r"[^A-Za-z0-9]+", "_", key) + "_" + _source_hash()
    path = os.path.join(d, name + ".o") if d else None
    if path and os.path.exists(path):
        try:
            module = cute.runtime.load_module(path, enable_tvm_ffi=True)
            fn = getattr(module, name)
            _MODULES.append(module)
            COMPILE_LOG.append((key + " [disk]", time.perf_counter() - t0))
            return fn
        except Exception as err:  # a stale or foreign file: recompile and overwrite
            warnings.warn(f"cute kernel cache: cannot load {path} ({err}); recompiling")
    fn = compile_fn()
    COMPILE_LOG.append((key, time.perf_counter() - t0))
    if path:
        try:
            os.makedirs(d, exist_ok=True)
            tmp = os.path.join(d, f".{name}.{os.getpid()}.o")
            fn.export_to_c(tmp, name)
            os.replace(tmp, path)
        except Exception as err:
            warnings.warn(f"cute kernel cache: cannot export {key} to {d} ({err})")
    return fn


def num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _sym():
    return cute.sym_int32()


def _fake(dtype, shape, stride):
    return make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)


def _options() -> str:
    opts = "--enable-tvm-ffi --gpu-arch sm_90a"
    dump = os.environ.get("SONIC_CUTE_DUMP_DIR")  # keep PTX/cubin for inspection
    if dump:
        os.makedirs(dump, exist_ok=True)
        opts += f" --keep-ptx --keep-cubin --dump-dir {dump}"
    return opts


@dataclass(frozen=True)
class Config:
    """Tile configuration of one kernel: output-tile width (a multiple of 16 from 64 to 256) and height, consumer
    schedule, cluster.

    "co256": cooperative, 128x256 tile split over both consumer warpgroups.
    "pp128": ping-pong, each warpgroup owns alternate 128x128 tiles.
    "pp192c2": ping-pong 128x192 tiles, CTAs in pairs that share (multicast) their A tile; only the
    kernels whose A is TMA-loaded (down, dx).
    "co128m256": cooperative 256x128 tiles, 128 rows per warpgroup; only the kernels whose A is TMA-loaded
    (down, dx, dw1). Against co256 it moves a tile's loads from B to A: dw1 gathers half the B rows per MMA.
    A trailing "s" (e.g. "pp192c2s") stages the tile through shared memory on its way out, as every kernel did
    before the register-direct stores (epilogue.DirectStoreEpilogue, DirectSwiGLUEpilogue, DirectDSwiGLUEpilogue),
    and so do widths the direct stores cannot take (not a multiple of 32; of 64 for the up-projection)."""
    tile_n: int
    pingpong: bool
    cluster: int = 1
    tile_m: int = 128
    staged: bool = False

    @staticmethod
    def parse(text: str) -> "Config":
        body = text.removesuffix("s")
        head = body.removesuffix("c2")
        head, _, rows = head.partition("m")
        if head[:2] not in ("co", "pp") or not head[2:].isdigit() or rows not in ("", "256"):
            raise ValueError(f"tile config {text!r}: expected co<tile_n> or pp<tile_n>, optionally followed by m256 "
                             f"(256-row tiles), c2 (a 2-CTA cluster) and s (a staged store), e.g. pp128, pp192c2, "
                             f"co128m256c2 or pp192c2s")
        return Config(int(head[2:]), head[:2] == "pp", 2 if body.endswith("c2") else 1, int(rows or 128), body != text)

    def __str__(self) -> str:
        return (f"{'pp' if self.pingpong else 'co'}{self.tile_n}" + (f"m{self.tile_m}" if self.tile_m != 128 else "")
                + ("c2" if self.cluster == 2 else "") + ("s" if self.staged else ""))


CLUSTERED = ("down", "dx")  # the varlen-M kernels whose A operand is TMA-loaded (multicast in a cluster)
TALL = ("down", "dx", "dw1")  # the kernels whose A operand is TMA-loaded (256-row tiles)


def check_config(kind: str, cfg: Config) -> None:
    """A ValueError naming what a tile config cannot do on this kernel (before anything compiles)."""
    problem = None
    if cfg.tile_n % 16 or not 64 <= cfg.tile_n <= 256:
        problem = "the tile width must be a multiple of 16 from 64 to 256 (the epilogue stores 16-column sub-tiles)"
    elif cfg.pingpong and cfg.tile_n > 192:
        problem = "a ping-pong warpgroup holds its whole tile in registers: 192 columns at most"
    elif kind == "dw1" and cfg.tile_n & (cfg.tile_n - 1):
        problem = "dw1 gathers its B tile with 128 threads in rows of tile_n / 8: a power of two"
    elif cfg.cluster > 1 and kind not in CLUSTERED:
        problem = f"clusters (c2) share a TMA-loaded A tile, which only {' and '.join(CLUSTERED)} have; drop the c2"
    elif cfg.tile_m == 256 and kind not in TALL:
        problem = f"256-row tiles (m256) need a TMA-loaded A tile, which only {', '.join(TALL)} have; drop the m256"
    elif cfg.tile_m == 256 and (cfg.pingpong or cfg.tile_n > 128):
        problem = "256-row tiles are cooperative (co) and at most 128 wide: each warpgroup holds 128 x tile_n"
    if problem:
        raise ValueError(f"tile config {cfg} for the {kind} kernel: {problem}")


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, dtype: torch.dtype, D: int, N: int, E: int, cfg: Config, sms: int):
    """Compile one kernel of the shape class (kind, dtype, D, N, E, config); T and R stay symbolic."""
    check_config(kind, cfg)
    dt = _DTYPES[dtype]
    tile_n, pp = cfg.tile_n, cfg.pingpong
    # epilogue sub-tiles of 32 columns where they divide the tile (fewer barriers), else 16; a 256-row tile stages
    # 16-column ones: 32 would cost a ring stage of shared memory
    epi_n = 16 if cfg.tile_m == 256 or tile_n % 32 else 32
    tile = dict(tile_m=cfg.tile_m, epi_n=epi_n)
    # tiles leave from registers (epilogue.DirectStoreEpilogue: blocks of 32 columns; DirectSwiGLUEpilogue: 64)
    # unless the config asks to stage them or the width does not divide
    store = DirectStoreEpilogue() if not cfg.staged and tile_n % 32 == 0 else StoreEpilogue()
    swiglu = DirectSwiGLUEpilogue() if not cfg.staged and tile_n % 64 == 0 else SwiGLUEpilogue()
    F = 2 * N
    T, R = _sym(), _sym()
    i32 = cutlass.Int32
    f32 = cutlass.Float32
    offsets = _fake(i32, (E + 1,), (1,))
    idx = _fake(i32, (R,), (1,))
    if kind == "up":  # H, A = SwiGLU(X[idx] W1^T)
        spec = GemmSpec("m", "a", E, tile_n=tile_n, pingpong=pp, num_sms=sms, **tile)
        epi = swiglu
        a = _fake(dt, (T, D), (D, 1))
        b = _fake(dt, (F, D, E), (D, 1, F * D))
        args = (_fake(dt, (R, F), (F, 1)), _fake(dt, (R, N), (N, 1)))
    elif kind == "down":  # Y = A W2^T
        spec = GemmSpec("m", None, E, tile_n=tile_n, pingpong=pp, cluster_n=cfg.cluster, num_sms=sms, **tile)
        epi = store
        a = _fake(dt, (R, N), (N, 1))
        b = _fake(dt, (D, N, E), (N, 1, D * N))
        args = (_fake(dt, (R, D), (D, 1)),)
    elif kind == "dh":  # dA' = dO[idx] W2, fused dSwiGLU
        spec = GemmSpec("m", "a", E, tile_n=tile_n, epi_n=16, pingpong=pp, num_sms=sms)
        epi = DirectDSwiGLUEpilogue() if not cfg.staged and tile_n % 32 == 0 else DSwiGLUEpilogue()
        a = _fake(dt, (T, D), (D, 1))
        b = _fake(dt, (N, D, E), (1, N, D * N))
        n_tiles = (N + tile_n - 1) // tile_n
        args = (_fake(dt, (R, F), (F, 1)), _fake(f32, (R,), (1,)), _fake(dt, (R, F), (F, 1)),
                _fake(dt, (R, N), (N, 1)), _fake(f32, (n_tiles, R), (R, 1)))
    elif kind == "dx":  # dX~ = dH W1
        spec = GemmSpec("m", None, E, tile_n=tile_n, pingpong=pp, cluster_n=cfg.cluster, num_sms=sms, **tile)
        epi = store
        a = _fake(dt, (R, F), (F, 1))
        b = _fake(dt, (D, F, E), (1, D, F * D))
        args = (_fake(dt, (R, D), (D, 1)),)
    elif kind == "dw1":  # dW1_e = dH_e^T X[idx_e]   (M = F, N = D, K = rows of e)
        spec = GemmSpec("k", "b", E, tile_n=tile_n, pingpong=pp, num_sms=sms, **tile)
        epi = store
        a = _fake(dt, (F, R), (1, F))
        b = _fake(dt, (D, T), (1, D))
        args = (_fake(dt, (F, D, E), (D, 1, F * D)),)
    elif kind == "dw2":  # dW2_e = dO[idx_e]^T A'_e   (M = D, N = N, K = rows of e)
        spec = GemmSpec("k", "a", E, tile_n=tile_n, pingpong=pp, num_sms=sms, **tile)
        epi = store
        a = _fake(dt, (D, T), (1, D))
        b = _fake(dt, (N, R), (1, N))
        args = (_fake(dt, (D, N, E), (N, 1, D * N)),)
    else:
        raise AssertionError(kind)
    gemm = GroupedGemm(spec, epi)
    return _compile_cached(
        f"{kind}/{str(dtype)[6:]}/D{D}/N{N}/E{E}/{cfg}/sm{sms}",
        lambda: cute.compile(gemm, a, b, offsets, idx, args,
                             make_fake_stream(use_tvm_ffi_env_stream=True), options=_options()))


def compiled(kind: str, dtype: torch.dtype, D: int, N: int, E: int, cfg: Config | str | None = None,
             rows: int | None = None):
    """The kernel for cfg, or for the default of its shape and of `rows` routed rows (padding included)."""
    if dtype not in _DTYPES:
        raise ValueError(f"the cute backend supports bf16/fp16 activations, got {dtype}")
    cfg = default_config(kind, D, N, rows // E if rows is not None else None) if cfg is None else cfg
    cfg = Config.parse(cfg) if isinstance(cfg, str) else cfg
    with _LOCK:
        return _compiled(kind, dtype, D, N, E, cfg, num_sms() if torch.cuda.is_available() else 132)


# dh, dw2: fastest on the 7B shape (H200 sweep, bench/results/2026-11-22-h200-cute-7b-sweep.json), and on the 30B and
# OLMoE shapes since (dh's co256 tied pp128 once both stored from registers, alone and in the block's f+b:
# bench/results/2026-11-29-h200-cute-block-tiles-ab.json). up, down and dx by their reduction length (SHORT_K): over a
# short one the epilogue weighs most, and ping-pong tiles hide one warpgroup's under the other's MMAs. up: pp128 up to
# D = 1536 (sonic_7b's 7B shape: the block's compiled forward 0.955x, f+b 0.984x the time of co256), co256 beyond (30B:
# pp128 1.017x; the same file). down and dx: CTA pairs that multicast A, in ping-pong tiles, 192 wide up to a reduction
# of 512, 128 wide beyond: 7-11% faster there than the 256-wide cooperative tiles before, on every shape swept (H200,
# interleaved rounds, bench/results/2026-11-25-h200-cute-sweep-*-{dx-dh,down,down-dx}.json). dw1: 256-row tiles, 4-6%
# faster than co256 on the 7B and 30B shapes (H200, bench/results/2026-11-25-h200-cute-sweep-{7b,30b}-m256.json).
DEFAULTS = {"up": ("pp128", "co256"), "down": ("pp192c2", "pp128c2"), "dh": "pp128", "dx": ("pp192c2", "pp128c2"),
            "dw1": "co128m256", "dw2": "co256"}
SHORT_K = {"up": 1536, "down": 512, "dx": 512}  # the longest reduction a tuple's first (short) config takes
# Few rows per expert (at most FEW_ROWS routed rows per expert on average, padding included; the token-rounding sweep's
# 256, and no Table 9b config: their fewest are Qwen3-Next's 640): each expert's weights serve two or three row tiles.
# There down takes 128-wide ping-pong pairs at every reduction (the kernel alone at n 512: as fast as pp192c2 on a top-K
# plan, 1.18x on a token-rounded one, which pp192c2 did not speed up at all) and dX~ 256-wide cooperative pairs
# (1.00-1.07x pp128c2's speed on both plans, at both of the sweep's shapes): H200, three rotated rounds,
# bench/results/2026-11-29-h200-cute_gemm-sparse-e{256,512}-{topk,rounded}-down-dx.json. In the experts' f+b the two
# together took 1.00x (E 256) and 1.01x (E 512) the time of the defaults before them on the top-K plan, 0.96x and
# 0.98x on the rounded one (bench/results/2026-11-29-h200-cute-fewrows-ab.json).
FEW_ROWS = 512
FEW_ROWS_DEFAULTS = {"down": "pp128c2", "dx": "co256c2"}


def reduction(kind: str, D: int, N: int) -> int:
    """The reduction length (K) of a varlen-M kernel: d for up, n for down, 2n for dX~."""
    return {"up": D, "down": N, "dx": 2 * N}[kind]


def default_config(kind: str, D: int, N: int, rows_per_expert: int | None = None) -> Config:
    """Per-kernel tile configuration, by shape and, where given, the routed rows per expert (FEW_ROWS); 256-wide (or
    256-tall) tiles only where they divide the output."""
    return tile_config(kind, D, N, rows_per_expert is not None and rows_per_expert <= FEW_ROWS)


@functools.lru_cache(maxsize=None)  # looked up at every launch: keyed by the few-rows class, never the row count
def tile_config(kind: str, D: int, N: int, few_rows: bool) -> Config:
    """default_config's answer for a shape and whether its experts have few routed rows (ops.FEW_ROWS)."""
    entry = FEW_ROWS_DEFAULTS.get(kind, DEFAULTS[kind]) if few_rows else DEFAULTS[kind]
    if isinstance(entry, tuple):  # (short reduction, long reduction)
        entry = entry[0] if reduction(kind, D, N) <= SHORT_K[kind] else entry[1]
    cfg = Config.parse(entry)
    if cfg.tile_m == 256 and 2 * N % 256:  # only dw1's rows (2n) are known before the routing
        cfg = Config(256, False)
    n_out = {"up": 2 * N, "down": D, "dh": N, "dx": D, "dw1": D, "dw2": N}[kind]
    if cfg.tile_n == 256 and n_out % 256:
        cfg = replace(cfg, tile_n=128)
    return cfg


def dh_tile_n(D: int, N: int, cfg: Config | str | None = None) -> int:
    cfg = default_config("dh", D, N) if cfg is None else cfg
    return (Config.parse(cfg) if isinstance(cfg, str) else cfg).tile_n


# --------------------------------------------------------------------------- launches
# Every launcher takes optional preallocated outputs (`out=`), which the tests poison.
def up_proj(x_TD: Tensor, w1_EFD: Tensor, token_idx_R: Tensor, offsets_E1: Tensor,
            cfg: Config | str | None = None, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """H = X[idx] W1_e^T per expert segment (R, 2N) and A = SwiGLU(H) (R, N)."""
    E, F, D = w1_EFD.shape
    R = token_idx_R.numel()
    h_RF, a_RN = out if out is not None else (x_TD.new_empty(R, F), x_TD.new_empty(R, F // 2))
    if R:
        fn = compiled("up", x_TD.dtype, D, F // 2, E, cfg)
        fn(x_TD, w1_EFD.permute(1, 2, 0), offsets_E1, token_idx_R, (h_RF, a_RN))
    return h_RF, a_RN


def down_proj(a_RN: Tensor, w2_EDN: Tensor, offsets_E1: Tensor, token_idx_R: Tensor,
              cfg: Config | str | None = None, out: Tensor | None = None) -> Tensor:
    """Y = A W2_e^T per expert segment (R, D)."""
    E, D, N = w2_EDN.shape
    R = a_RN.shape[0]
    y_RD = out if out is not None else a_RN.new_empty(R, D)
    if R:
        fn = compiled("down", a_RN.dtype, D, N, E, cfg, rows=R)
        fn(a_RN, w2_EDN.permute(1, 2, 0), offsets_E1, token_idx_R, (y_RD,))
    return y_RD


def dh(dout_TD: Tensor, w2_EDN: Tensor, h_RF: Tensor, scores_R: Tensor, token_idx_R: Tensor,
       offsets_E1: Tensor, cfg: Config | str | None = None,
       out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dH (R, 2N), A' = s*A (R, N) and dS (R,) fp32 from dA' = dO[idx] W2_e."""
    E, D, N = w2_EDN.shape
    R = h_RF.shape[0]
    n_tiles = -(-N // dh_tile_n(D, N, cfg))
    if out is not None:
        dh_RF, ap_RN, ds_PR = out
    else:
        dh_RF, ap_RN = torch.empty_like(h_RF), h_RF.new_empty(R, N)
        ds_PR = torch.empty(n_tiles, R, dtype=torch.float32, device=h_RF.device)
    assert ds_PR.shape == (n_tiles, R)
    if R:
        fn = compiled("dh", dout_TD.dtype, D, N, E, cfg)
        fn(dout_TD, w2_EDN.permute(2, 1, 0), offsets_E1, token_idx_R,
           (h_RF, scores_R.float().contiguous(), dh_RF, ap_RN, ds_PR))
    return dh_RF, ap_RN, ds_PR.sum(0)


def dx_rows(dh_RF: Tensor, w1_EFD: Tensor, offsets_E1: Tensor, token_idx_R: Tensor,
            cfg: Config | str | None = None, out: Tensor | None = None) -> Tensor:
    """dX~ = dH W1_e per expert segment (R, D)."""
    E, F, D = w1_EFD.shape
    R = dh_RF.shape[0]
    dxt_RD = out if out is not None else dh_RF.new_empty(R, D)
    if R:
        fn = compiled("dx", dh_RF.dtype, D, F // 2, E, cfg, rows=R)
        fn(dh_RF, w1_EFD.permute(2, 1, 0), offsets_E1, token_idx_R, (dxt_RD,))
    return dxt_RD


def dw1(dh_RF: Tensor, x_TD: Tensor, token_idx_R: Tensor, offsets_E1: Tensor, E: int,
        cfg: Config | str | None = None, out: Tensor | None = None) -> Tensor:
    """dW1_e = dH_e^T X[idx_e] (E, 2N, D); experts without rows get zeros."""
    R, F = dh_RF.shape
    D = x_TD.shape[1]
    dw1_EFD = out if out is not None else dh_RF.new_empty(E, F, D)
    if R == 0:
        return dw1_EFD.zero_()
    fn = compiled("dw1", dh_RF.dtype, D, F // 2, E, cfg)
    fn(dh_RF.t(), x_TD.t(), offsets_E1, token_idx_R, (dw1_EFD.permute(1, 2, 0),))
    return dw1_EFD


def dw2(dout_TD: Tensor, ap_RN: Tensor, token_idx_R: Tensor, offsets_E1: Tensor, E: int,
        cfg: Config | str | None = None, out: Tensor | None = None) -> Tensor:
    """dW2_e = dO[idx_e]^T A'_e (E, D, N); experts without rows get zeros."""
    R, N = ap_RN.shape
    D = dout_TD.shape[1]
    dw2_EDN = out if out is not None else ap_RN.new_empty(E, D, N)
    if R == 0:
        return dw2_EDN.zero_()
    fn = compiled("dw2", ap_RN.dtype, D, N, E, cfg)
    fn(dout_TD.t(), ap_RN.t(), offsets_E1, token_idx_R, (dw2_EDN.permute(1, 2, 0),))
    return dw2_EDN


@functools.lru_cache(maxsize=None)
def _compiled_gather_sum(dtype: torch.dtype, D: int, weighted: bool, max_per_lane: int):
    dt = _DTYPES[dtype]
    T, R = _sym(), _sym()
    return _compile_cached(
        f"gather_sum/{str(dtype)[6:]}/D{D}/w{int(weighted)}/l{max_per_lane}",
        lambda: cute.compile(GatherSum(D, weighted, max_per_lane), _fake(dt, (R, D), (D, 1)),
                             _fake(cutlass.Float32, (R,), (1,)) if weighted else None,
                             _fake(cutlass.Int32, (_sym(),), (1,)),  # token offsets (T + 1,)
                             _fake(cutlass.Int32, (R,), (1,)), _fake(dt, (T, D), (D, 1)),
                             make_fake_stream(use_tvm_ffi_env_stream=True), options=_options()))


def gather_sum(rows_RD: Tensor, token_offsets_T1: Tensor, rows_by_token_R: Tensor,
               weight_R: Tensor | None = None, out: Tensor | None = None, max_per_lane: int | None = None) -> Tensor:
    """out_t = sum over token t's rows (rows_by_token order) of (w_r *) rows_r, fp32 accumulation.
    max_per_lane: 16-byte chunks per lane and column slice (aggregate.default_max_per_lane when None)."""
    R, D = rows_RD.shape
    T = token_offsets_T1.numel() - 1
    out_TD = out if out is not None else rows_RD.new_empty(T, D)
    if T:
        weighted = weight_R is not None
        lanes = default_max_per_lane(D, weighted) if max_per_lane is None else max_per_lane
        with _LOCK:
            fn = _compiled_gather_sum(rows_RD.dtype, D, weighted, lanes)
        w = None if weight_R is None else weight_R.float().contiguous()
        fn(rows_RD, w, token_offsets_T1, rows_by_token_R, out_TD)
    return out_TD
