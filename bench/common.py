"""Shared benchmark helpers: GPU naming, timing, tables and result files.

Results go to bench/results/<date>-<gpu>-<what>.json together with the exact command and the commit.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def gpu_name() -> str:
    """Short device tag for file names, e.g. 'h100' or 'cpu'."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for tag in ("h200", "h100", "b200", "a100", "l40s", "l4"):
        if tag in name:
            return tag
    return name.replace("nvidia", "").strip().replace(" ", "_")


def command_line() -> str:
    """The command that ran this process: `python -m module ...`, or `python path/to/script.py ...` for a script run
    by its path (which `-m <its file name>` would not rerun)."""
    main = sys.modules.get("__main__")
    module = getattr(getattr(main, "__spec__", None), "name", None)
    head = ["-m", module] if module else [sys.argv[0]]
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *head] + sys.argv[1:])


def result_path(what: str, explicit: str | None = None) -> Path:
    if explicit:
        return Path(explicit)
    return RESULTS / f"{datetime.date.today().isoformat()}-{gpu_name()}-{what}.json"


def git_commit() -> str:
    """The commit this tree is: $SONIC_COMMIT where it is set (the GPU machine gets a copy of the working tree,
    and a .git it may carry is not the copy's: one recorded the session's first commit for every run); else
    git's short HEAD where this checkout is a git repository, with "+modified" when tracked files differ from it
    (so a copy whose .git is stale, or a run before a commit, never passes for HEAD); else "unknown"."""
    if os.environ.get("SONIC_COMMIT"):
        return os.environ["SONIC_COMMIT"]
    try:
        proc = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True)
        top, head = proc.stdout.split() if proc.returncode == 0 else ("", "")
    except (OSError, ValueError):  # no git here, or not the two lines asked for
        top, head = "", ""
    if not top or Path(top).resolve() != REPO.resolve():  # no git, or some repository around a copy
        return "unknown"
    modified = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO, capture_output=True).returncode != 0
    return head + ("+modified" if modified else "")


def write_json(path: Path, payload: dict) -> Path:
    """Writes payload with the command, date, commit (payload's own wins), device and torch, and copies it to
    $OUT when there is one (the GPU machine's return folder) and the file is a result under bench/results/; a
    file written elsewhere (a test's temporary folder, an explicit path) is where its caller wants it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": command_line(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "commit": git_commit(), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, **payload}
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    out_dir = os.environ.get("OUT")
    if out_dir and path.resolve().is_relative_to(RESULTS.resolve()):
        Path(out_dir, path.name).write_text(path.read_text())
    return path


def compose_config(overrides: list[str]):
    """The run config the trainer would get from `train.py <overrides>` (Hydra, configs/, the dataclass schema)."""
    from hydra import compose, initialize_config_dir  # noqa: PLC0415 (Hydra: only the benches that train)

    from sonic.train.config import register_schema, to_config  # noqa: PLC0415

    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def held_bytes(forward: Callable[[], object], cuda: bool) -> int | None:
    """Bytes that forward() allocates and keeps for the backward, less its output (the first result when it
    returns a tuple: the rest, e.g. a loss, stays alive while memory is read); None off CUDA."""
    if not cuda:
        return None
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    result = forward()
    torch.cuda.synchronize()
    out = result[0] if isinstance(result, tuple) else result
    held = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    del result, out
    return held


def cuda_or_exit(device: str, script: str) -> bool:
    """Whether a benchmark's --device is CUDA; a SystemExit naming the CPU smoke mode when it is and no GPU is."""
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU (or --device cpu for a smoke test)")
    return cuda


def bench_ms(fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] = (), warmup: int = 25,
             rep: int = 100) -> float:
    """Median milliseconds of fn() on the GPU (triton.testing.do_bench: events, L2 flushed)."""
    if not torch.cuda.is_available():  # CPU smoke runs only: a few host-timed calls
        times = []
        for _ in range(3):
            for t in grad_to_none:
                t.grad = None
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=list(grad_to_none) or None,
                    return_mode="median")


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def profiled(step: Callable[[], object], cuda: bool, cpu_too: bool = False):
    """(wall ms, torch.profiler result) of one step(), recording CUDA kernels on a GPU, CPU ops otherwise (and
    also, with cpu_too, the host ops that issue the kernels)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    activities = [ProfilerActivity.CUDA] if cuda else []
    with profile(activities=activities + ([ProfilerActivity.CPU] if cpu_too or not cuda else [])) as prof:
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - t0)
    return wall_ms, prof


GPU_OPS = ("kernel", "gpu_memcpy", "gpu_memset")  # chrome-trace categories of work on the GPU
LAUNCHES = ("cuda_runtime", "cuda_driver")  # of the host calls that queue it (cudaLaunchKernel, cuLaunchKernel, ...)


def gpu_gaps(events: list[dict], top: int = 25) -> dict:
    """Where the GPU idles in a chrome trace of one step (torch.profiler's export_chrome_trace, with CUDA activity):
    the GPU's work merged into busy time, and each gap before its next op, host-bound when the host call that
    queued that op ended after the GPU went idle (the GPU waited for the launch), else queued (a dependency, or the
    launch latency). Milliseconds: span, busy, idle, idle_host_bound, idle_unlinked (no launch record for the op);
    idle by gap size; the ops after the most idle time, and the largest gaps."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_OPS and "dur" in e), key=lambda e: e["ts"])
    if not gpu:
        return {}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    end, busy, prev, gaps = gpu[0]["ts"], 0.0, gpu[0], []
    for e in gpu:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if start > end:
            launch = launches.get(e.get("args", {}).get("correlation"))
            issued_late = launch is not None and launch["ts"] + launch.get("dur", 0) > end
            why = "unlinked" if launch is None else "host_bound" if issued_late else "queued"
            gaps.append(((start - end) / 1e3, prev["name"], e["name"], why))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev = stop, e
    by_size = dict.fromkeys(("under 5 us", "5 to 100 us", "100 us or more"), 0.0)
    by_next: dict[tuple[str, str], float] = {}
    for ms, _, name, why in gaps:
        by_size["under 5 us" if ms < 5e-3 else "5 to 100 us" if ms < 0.1 else "100 us or more"] += ms
        by_next[name, why] = by_next.get((name, why), 0.0) + ms
    idle = sum(g[0] for g in gaps)
    return {"span_ms": (end - gpu[0]["ts"]) / 1e3, "busy_ms": busy / 1e3, "idle_ms": idle,
            **{f"idle_{why}_ms": sum(g[0] for g in gaps if g[3] == why) for why in ("host_bound", "unlinked")},
            "idle_ms_by_gap": by_size,
            "idle_before": [{"op": n, "why": w, "ms": ms} for (n, w), ms in
                            sorted(by_next.items(), key=lambda kv: -kv[1])[:top]],
            "largest": [{"ms": ms, "after": a, "before": b, "why": w} for ms, a, b, w in
                        sorted(gaps, key=lambda g: -g[0])[:top]]}


def kernel_times(prof, cuda: bool) -> list[tuple[str, float, int]]:
    """(name, ms, calls) of a torch.profiler result: per CUDA kernel on a GPU, per operator's self CPU time
    otherwise; slowest first, those that took no time left out."""
    spent = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    return sorted(((e.key, spent(e) / 1e3, e.count) for e in prof.key_averages() if spent(e) > 0),
                  key=lambda k: -k[1])


def median_ms(fn: Callable[[], object], steps: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of fn() over `steps` calls after `warmup` calls (CUDA events on a GPU)."""
    times = []
    for i in range(warmup + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = 1e3 * (time.perf_counter() - t0)
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def host_bound(fn: Callable[[], object], steps: int) -> dict[str, float]:
    """Whether fn() waits on the host, on a GPU (after warm-up): the medians of the milliseconds the CPU takes to
    issue it and until the GPU has finished it, the cudaMalloc and cudaFree calls per call (each of which
    synchronises the device), and where one more call synchronises (`sync_sites`). Issue time near the wall
    time: the GPU waits for the CPU (launch overhead, or a sync inside fn); much lower: the GPU is the bound."""
    issue, wall, mallocs = [], [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        after = torch.cuda.memory_stats()
        issue.append(1e3 * (t1 - t0))
        wall.append(1e3 * (t2 - t0))
        mallocs.append(sum(after.get(k, 0) - before.get(k, 0) for k in ("num_device_alloc", "num_device_free")))
    return {"issue_ms": statistics.median(issue), "wall_ms": statistics.median(wall),
            "device_mallocs_and_frees": statistics.median(mallocs), "syncs": sync_sites(fn)}


def sync_sites(fn: Callable[[], object]) -> list[str]:
    """file:line of each synchronising CUDA call fn() makes, as torch's sync debug mode warns of them (a sync in
    the backward's C++ threads is reported at the next line that enters torch)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing CUDA operation" in str(w.message)]


def interleaved_ms(fns: dict[str, Callable[[], object]], grad_to_none: dict[str, Sequence[torch.Tensor]],
                   rounds: int = 5, warmup: int = 25, rep: int = 100) -> dict[str, list[float]]:
    """Per name, bench_ms of fns[name] once per round, the names alternating within each round
    (A B A B ..., not A A B B), so clock or thermal drift reaches every fn alike; take medians."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench_ms(fn, grad_to_none.get(name, ()), warmup, rep))
    return times
