"""Bounded, cached kernel configs.

Each kernel has a short curated list of tile configs. The choice is keyed by the shape
class (kernel, d, n, E bucket, dtype), never by the routed-row count R: R changes every
step under token rounding and must cost neither a re-tune nor a recompile (R is also a
`do_not_specialize` argument of every kernel).

Tuning is off by default (tests and CI run the fixed default, the first candidate).
Set SONIC_TRITON_AUTOTUNE=1 (or call `set_autotune(True)`) to time every candidate once
per shape class on the live inputs and keep the fastest for the rest of the process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Config:
    bm: int  # rows of the tile (routed rows, or the first output dim for varlen-K)
    bn: int  # output columns of the tile
    bk: int  # reduction step
    warps: int
    stages: int

    def kwargs(self) -> dict:
        return dict(BM=self.bm, BN=self.bn, BK=self.bk, num_warps=self.warps, num_stages=self.stages)


# First entry = default. Varlen-M kernels: (bm rows, bn out cols, bk); varlen-K: (bm = out
# rows, bn = out cols, bk = routed rows per step). The up-projection's bn counts H columns
# (gate and up), i.e. bn/2 SwiGLU outputs.
CANDIDATES: dict[str, tuple[Config, ...]] = {
    # (picked so that none spills registers on sm_90: checked with ptxas -v; see README.md)
    "up": (Config(128, 256, 64, 8, 3), Config(128, 256, 64, 8, 4), Config(128, 128, 64, 8, 4),
           Config(128, 128, 64, 4, 3)),
    "down": (Config(128, 256, 64, 8, 4), Config(256, 128, 64, 8, 3), Config(128, 128, 64, 8, 4),
             Config(128, 256, 32, 8, 4)),
    # W1 through TMA, persistent (gemm.up_proj_tma_kernel): 128 x 256 at 3 stages was the fastest of six tried at
    # 30B's and 120B's shapes on an H200, 4 stages at sonic_7b's (`python -m bench.triton_gemm_ab --products up`:
    # bench/results/2026-11-26-h200-triton_gemm_ab-up.json)
    "up_tma": (Config(128, 256, 64, 8, 3), Config(128, 256, 64, 8, 4), Config(128, 128, 64, 8, 4),
               Config(64, 256, 64, 4, 4)),
    # the same products through TMA, persistent (gemm.varlen_m_tma_kernel), four tiles timed at sonic_7b's, 30B's
    # and 120B's shapes on an H200 (`python -m bench.triton_gemm_ab`: bench/results/2026-11-26-h200-triton_gemm_ab.json):
    # 128 x 256 was the fastest for both; 3 stages for the down-projection at 30B (4 was within 5% elsewhere), 4 for
    # dX~ at all three (by 1-9%)
    "down_tma": (Config(128, 256, 64, 8, 3), Config(128, 256, 64, 8, 4), Config(256, 128, 64, 8, 3),
                 Config(128, 128, 64, 4, 4)),
    "dxt_tma": (Config(128, 256, 64, 8, 4), Config(128, 256, 64, 8, 3), Config(256, 128, 64, 8, 3),
                Config(128, 128, 64, 4, 4)),
    # dh: one dot per tile, its epilogue by column quarters (none of these spills on sm_90). 5 stages beat 4 at
    # 30B's, 120B's and sonic_7b's shapes on an H200, three rotated rounds, with H prefetched or not; 64-row tiles
    # on 4 warps (two CTAs per SM) lost at all three (bench/results/2026-11-28-h200-triton-dh-prefetch-ab.json)
    "dh": (Config(128, 128, 64, 8, 5), Config(128, 128, 64, 8, 4), Config(64, 128, 64, 8, 4),
           Config(64, 256, 64, 8, 4), Config(128, 128, 64, 8, 3)),
    "dxt": (Config(128, 256, 64, 8, 3), Config(128, 256, 64, 8, 4), Config(256, 128, 64, 8, 3),
            Config(128, 128, 64, 8, 4)),
    # varlen-K loads go through a gathered index inside the loop: the pipeliner keeps
    # num_stages - 2 operand buffers there, hence the deeper stage counts
    "dw": (Config(128, 128, 64, 8, 5), Config(128, 256, 64, 8, 5), Config(128, 128, 64, 8, 4),
           Config(128, 256, 64, 8, 4)),
    # the contiguous operand (dH for dW1, A' for dW2) by TMA (gemm.varlen_k_tma_kernel): dW2's first tile was the
    # fastest of five tiles at 30B's and sonic_7b's shapes on an H200, by both paths
    # (`python -m bench.triton_gemm_ab --products dh,dw1,dw2`: bench/results/2026-11-28-h200-triton_gemm_ab-bwd-3a3a37f.json).
    # dW1's 256 rows of dH (by TMA) to 128 gathered X columns, 32-row steps so that 7 stages fit: 11-14% less time than
    # 128 x 128 x 64 at 30B's, 120B's and sonic_7b's shapes (H200, four rotated rounds:
    # bench/results/2026-11-28-h200-triton-dw1-tiles-ab.json; 8 stages compiles to the same kernel on sm_90, 182
    # registers, no spills); the gathered operand stays 128 wide, so its pointer loads stay few per thread
    "dw1_tma": (Config(256, 128, 32, 8, 7), Config(128, 128, 64, 8, 5), Config(128, 128, 64, 8, 4),
                Config(128, 256, 64, 8, 5)),
    "dw2_tma": (Config(128, 256, 64, 8, 5), Config(128, 128, 64, 8, 5), Config(128, 128, 64, 8, 4),
                Config(128, 256, 64, 8, 4)),
}

_autotune = os.environ.get("SONIC_TRITON_AUTOTUNE", "0") == "1"
_chosen: dict[tuple, Config] = {}
tune_log: list[tuple[tuple, Config, dict]] = []  # (key, winner, {config: ms}) per tuning


def set_autotune(enabled: bool) -> None:
    global _autotune
    _autotune = enabled


def autotune_enabled() -> bool:
    return _autotune


def e_bucket(num_experts: int) -> int:
    return 1 << max(num_experts - 1, 0).bit_length()


def fit(cfg: Config, n_out: int, k: int) -> Config:
    """Shrink tiles that exceed a small problem (tiny d or n); keeps powers of two >= 16."""
    def cap(v: int, size: int) -> int:
        return max(16, min(v, 1 << max(size - 1, 0).bit_length()))
    return Config(cfg.bm, cap(cfg.bn, n_out), cap(cfg.bk, k), cfg.warps, cfg.stages)


def halves(cfg: Config) -> Config:
    """For kernels that split bn into two dots of bn/2 columns (the up-projection): each >= 16 wide."""
    return Config(cfg.bm, max(32, cfg.bn), cfg.bk, cfg.warps, cfg.stages)


def choose(kernel: str, key: tuple, run: Callable[[Config], object],
           adjust: Callable[[Config], Config] = lambda c: c) -> Config:
    """Config for `kernel` on shape class `key`; `run(cfg)` launches it (used only when tuning)."""
    full_key = (kernel,) + key
    cfg = _chosen.get(full_key)
    if cfg is not None:
        return cfg
    candidates = list(dict.fromkeys(adjust(c) for c in CANDIDATES[kernel]))
    if not _autotune or len(candidates) == 1:
        cfg = candidates[0]
    else:
        from triton.testing import do_bench

        times = {}
        for c in candidates:
            try:
                times[c] = do_bench(lambda c=c: run(c), warmup=5, rep=20, return_mode="median")
            except Exception as err:  # e.g. out of shared memory on a smaller GPU  # noqa: BLE001
                times[c] = float("inf")
                print(f"[sonic.triton] {kernel} {c} failed: {type(err).__name__}: {err}")
        cfg = min(times, key=times.get)
        tune_log.append((full_key, cfg, {str(c): t for c, t in times.items()}))
    _chosen[full_key] = cfg
    return cfg


def chosen() -> dict[tuple, Config]:
    return dict(_chosen)


def reset() -> None:
    _chosen.clear()
    tune_log.clear()
