"""Energy per call and the SM clock of a GPU workload held for a while, as training holds it.

A kernel timed alone between L2 flushes (do_bench) and the same kernel among others at the GPU's power cap can
run at different clocks: the gathered up-projection took 3.2-3.8 ms by what ran before it while cuBLAS's dense
GEMM of equal FLOPs held its time (bench/results/2026-11-29-h200-cute-m256-gathered-ab.json). Where the cap sets
the clock, a kernel's sustained speed follows its energy per FLOP. `sustained(fn)` runs fn back to back for a
fixed wall time and reads the driver's energy counter (NVML, through ctypes: no Python package) before and after,
and the SM clock and power while it runs.

    python bench/cute_gemm.py --shape 30b --energy        (each kernel's and cuBLAS's equal-FLOP GEMM's row)
"""
from __future__ import annotations

import ctypes
import os
import statistics
import time
from typing import Callable

import torch

NVML_CLOCK_SM = 1


class NvmlUnavailable(RuntimeError):
    """The driver's NVML library or the device is not there (a CPU machine, a container without it)."""


class Nvml:
    """One GPU's counters through libnvidia-ml (the driver's library); `open` raises NvmlUnavailable, naming why,
    where it cannot read them."""

    def __init__(self, lib: ctypes.CDLL, handle: ctypes.c_void_p):
        self._lib, self._handle = lib, handle

    @classmethod
    def open(cls, cuda_index: int = 0) -> "Nvml":
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as e:
            raise NvmlUnavailable(f"no NVML library ({e})") from None
        if lib.nvmlInit_v2() != 0:
            raise NvmlUnavailable("NVML did not initialise (nvmlInit_v2)")
        handle = ctypes.c_void_p()
        index = nvml_index(cuda_index, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
            raise NvmlUnavailable(f"NVML has no device {index}")
        return cls(lib, handle)

    def _read(self, fn: str, value, *args):
        rc = getattr(self._lib, fn)(self._handle, *args, ctypes.byref(value))
        if rc != 0:
            raise RuntimeError(f"{fn} failed (NVML error {rc})")
        return value.value

    def energy_mj(self) -> int:
        """Energy the GPU has used since the driver loaded, in millijoules."""
        return self._read("nvmlDeviceGetTotalEnergyConsumption", ctypes.c_ulonglong())

    def sm_mhz(self) -> int:
        return self._read("nvmlDeviceGetClockInfo", ctypes.c_uint(), ctypes.c_int(NVML_CLOCK_SM))

    def power_w(self) -> float:
        return self._read("nvmlDeviceGetPowerUsage", ctypes.c_uint()) / 1000.0


def nvml_index(cuda_index: int, visible: str | None) -> int:
    """NVML numbers every GPU on the machine; CUDA only those CUDA_VISIBLE_DEVICES lists, in its order."""
    ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if ids and all(v.isdigit() for v in ids):
        return int(ids[cuda_index])
    return cuda_index  # unset, or UUIDs (not mapped here): the machines this runs on show one GPU


def sustained(fn: Callable[[], object], nvml: Nvml, seconds: float = 1.0, warmup_s: float = 0.3, batch: int = 8,
              sync: Callable[[], None] = torch.cuda.synchronize) -> dict:
    """fn back to back for about `seconds` after `warmup_s` of the same: wall ms and joules per call (the queue
    drained after every `batch` launches, so the wall time is the GPU's), mean watts, and the SM clock and power
    sampled between batches while the GPU still runs the queued launches."""
    def run(for_s: float, sample: bool):
        calls, clocks, watts = 0, [], []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < for_s:
            for _ in range(batch):
                fn()
            calls += batch
            if sample:
                clocks.append(nvml.sm_mhz())
                watts.append(nvml.power_w())
            sync()  # bounds the queue, so the wall time is the GPU's
        return calls, time.perf_counter() - t0, clocks, watts

    run(warmup_s, False)
    sync()
    e0 = nvml.energy_mj()
    calls, wall_s, clocks, watts = run(seconds, True)
    joules = (nvml.energy_mj() - e0) / 1000.0
    return {"calls": calls, "ms": wall_s * 1e3 / calls, "joules_per_call": joules / calls, "watts": joules / wall_s,
            "sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
            "power_w_median": statistics.median(watts)}
