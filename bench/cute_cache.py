"""Fill a cute kernel cache folder on the CPU, so that a fresh GPU machine loads the kernels a run takes instead of
compiling them on device time (the CuTe DSL compiles for sm_90a without a GPU: 1-4 s a kernel here).

Which kernels:
  --configs / --shape  each config's six GEMM kernels at their default tiles and its two gather-sums (bf16), the
                       kernels bench.moe_block's and the trainer's blocks take at Table 9b shapes (all twelve when
                       neither is given and there is no --from)
  --from DIR           every kernel named by DIR's object files (an earlier cache, e.g. the cute_cache.tar.gz a device
                       stage brought back), compiled again under this tree's sources: the GPU tests' shapes, after a
                       change to the kernel sources made the old files stale
Objects already in --out for this tree's sources are loaded, not compiled. --jobs N splits the kernels over N
processes (the DSL compiles on one thread per process). Kernels are compiled for --sms SMs (132: H100 SXM and H200).

Carry the folder as .cute_cache: bench/gpu.sh copies it into SONIC_CUTE_CACHE_DIR on the machine.

Run:   python -m bench.cute_cache --out .cute_cache [--configs 7B,30B] [--from OLD_DIR] [--jobs 2]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path

from bench.moe_configs import TABLE_9B_NAMES, select_configs

DTYPES = ("bfloat16", "float16")
# ops._compile_cached's object names: "sonic_" + the kernel key with every run of other characters as "_" + "_<hash>.o"
GEMM_NAME = re.compile(r"sonic_(up|down|dh|dx|dw1|dw2)_(b?float16)_D(\d+)_N(\d+)_E(\d+)_([a-z0-9]+)_sm(\d+)"
                       r"_[0-9a-f]{16}\.o")
GATHER_SUM_NAME = re.compile(r"sonic_gather_sum_(b?float16)_D(\d+)_w([01])_l(\d+)_[0-9a-f]{16}\.o")


def kernels_of_object(name: str) -> tuple | None:
    """The kernel an object file holds, as a job (see compile_job), or None for a file of another name."""
    if m := GEMM_NAME.fullmatch(name):
        kind, dtype, D, N, E, cfg, sms = m.groups()
        return ("gemm", kind, dtype, int(D), int(N), int(E), cfg, int(sms))
    if m := GATHER_SUM_NAME.fullmatch(name):
        dtype, D, weighted, lanes = m.groups()
        return ("gather_sum", dtype, int(D), weighted == "1", int(lanes))
    return None


def kernels_of_config(shape, sms: int) -> list[tuple]:
    """A config's default kernels (bf16): what its block takes on top-K routing."""
    from sonic.kernels.cute import ops  # noqa: PLC0415 - the CuTe DSL, only where kernels are named by shape
    from sonic.kernels.cute.aggregate import default_max_per_lane  # noqa: PLC0415

    T, D, N, E, K = shape
    rows_per_expert = T * K // E
    jobs = [("gemm", kind, "bfloat16", D, N, E, str(ops.default_config(kind, D, N, rows_per_expert)), sms)
            for kind in ("up", "down", "dh", "dx", "dw1", "dw2")]
    return jobs + [("gather_sum", "bfloat16", D, weighted, default_max_per_lane(D, weighted))
                   for weighted in (True, False)]


def compile_job(job: tuple) -> tuple[tuple, float, bool]:
    """Compile (or load) one kernel into SONIC_CUTE_CACHE_DIR: (job, seconds, whether it was compiled)."""
    import torch  # noqa: PLC0415
    from sonic.kernels.cute import ops  # noqa: PLC0415

    dtype = getattr(torch, job[1] if job[0] == "gather_sum" else job[2])
    logged = len(ops.COMPILE_LOG)
    t0 = time.perf_counter()
    if job[0] == "gemm":
        _, kind, _, D, N, E, cfg, sms = job
        ops._compiled(kind, dtype, D, N, E, ops.Config.parse(cfg), sms)
    else:
        _, _, D, weighted, lanes = job
        ops._compiled_gather_sum(dtype, D, weighted, lanes)
    compiled = any(not key.endswith("[disk]") for key, _ in ops.COMPILE_LOG[logged:])
    return job, time.perf_counter() - t0, compiled


def _worker_init(out: str) -> None:
    os.environ["SONIC_CUTE_CACHE_DIR"] = out


def fill(jobs: list[tuple], out: Path, processes: int) -> list[tuple[tuple, float, bool]]:
    """Every job's kernel in `out`, over `processes` processes (1: this one)."""
    out.mkdir(parents=True, exist_ok=True)
    if processes <= 1:  # in this process: the caller's SONIC_CUTE_CACHE_DIR comes back afterwards
        before = os.environ.get("SONIC_CUTE_CACHE_DIR")
        _worker_init(str(out))
        try:
            return [compile_job(j) for j in jobs]
        finally:
            if before is None:
                os.environ.pop("SONIC_CUTE_CACHE_DIR")
            else:
                os.environ["SONIC_CUTE_CACHE_DIR"] = before
    with multiprocessing.get_context("spawn").Pool(processes, _worker_init, (str(out),)) as pool:
        return pool.map(compile_job, jobs, chunksize=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the cache folder to fill (carried as .cute_cache)")
    ap.add_argument("--configs", default=None, help=f"comma list of Table 9b configs ({', '.join(TABLE_9B_NAMES)})")
    ap.add_argument("--shape", action="append", default=[], help="an extra config T,d,n,E,K (repeatable)")
    ap.add_argument("--from", dest="source", default=None, help="a folder whose object files name more kernels")
    ap.add_argument("--sms", type=int, default=132, help="SM count the kernels are compiled for")
    ap.add_argument("--jobs", type=int, default=1, help="processes compiling in parallel")
    args = ap.parse_args(argv)
    from sonic.kernels import cute  # noqa: PLC0415

    if (why := cute._cutlass_reason()) is not None:
        ap.error(f"{why}: the CuTe DSL compiles these kernels (pip install -e '.[dev]' has it)")
    try:
        default = [] if args.source else TABLE_9B_NAMES
        configs = select_configs(args.configs, args.shape, default)
    except ValueError as err:
        ap.error(str(err))
    jobs = [j for shape in configs.values() for j in kernels_of_config(shape, args.sms)]
    if args.source:
        source = Path(args.source)
        if not source.is_dir():
            ap.error(f"--from {source}: not a folder (unpack a cute_cache.tar.gz into one first)")
        named = [kernels_of_object(p.name) for p in sorted(source.iterdir())]
        jobs += [j for j in named if j is not None]
    jobs = list(dict.fromkeys(jobs))  # each kernel once, in order
    t0 = time.perf_counter()
    done = fill(jobs, Path(args.out), args.jobs)
    for job, seconds, compiled in done:
        print(f"{'compiled' if compiled else 'loaded  '} {seconds:5.1f}s  {' '.join(map(str, job[1:]))}")
    n_compiled = sum(compiled for _, _, compiled in done)
    print(f"{len(done)} kernels in {args.out} ({n_compiled} compiled, {len(done) - n_compiled} already there), "
          f"{time.perf_counter() - t0:.0f}s with {args.jobs} process(es)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
