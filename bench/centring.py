"""The router's prefix centring (routing.input_centring=prefix) alone: the fused Triton kernels
(sonic/kernels/triton/centring.py, what the triton routing backend runs) against the definition (plain PyTorch,
sonic/routing/scores.py) and the plain linear router (routing.input_centring=none), forward and backward, with the
fused path's error against an fp64 evaluation of the definition.

Per shape T x D x E (bf16 x and W, sequences of --seq-len): median ms of each (do_bench after warm-up).
--sweep adds tile configurations of the fused forward, BS,BD,num_warps[,num_stages] each (positions per chunk,
features per block and warps of the sums and rstd kernels, and the rstd kernel's pipeline depth, Triton's default
when left out), beside the default (`centring._forward_tiles`): a bounded sweep, since the kernels have no
autotuner. The sweep stands a config in for `_forward_tiles` while it calls the kernels (a benchmark-only
substitution; nothing in sonic/ reads a config from outside). Every config's calls alternate within each of
--rounds rounds, so clock drift reaches them alike (timed one after another, the first config ran while the
clocks settled); each time is the median over the rounds.

    python -m bench.centring [--shapes 16384x1536x128,32768x4096x128,32768x2048x64] [--seq-len 4096]
                             [--sweep 32,64,4/64,128,4,3] [--rounds 5] [--profile N] [--json out.json]
                             [--baseline old_centring.py]
    TRITON_INTERPRET=1 python -m bench.centring --shapes 128x64x16 --seq-len 32   (CPU: a smoke run; no timings)

--baseline FILE times another version of sonic/kernels/triton/centring.py (e.g. `git show REV:sonic/kernels/triton/
centring.py > old.py`) beside the default, in the same process and the same alternating rounds: an A/B of a kernel
change with no other difference between the two sides.

--profile N adds, per shape, where the default config's time goes: each kernel's mean microseconds per call over N
forward and N backward calls under torch.profiler, and the GPU's idle time between them (bench.common.gpu_gaps).

Writes bench/results/<date>-<gpu>-centring.json (or --json): per shape the times, the default config and every
swept one with its error, the profile, with the command, date and commit.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import tempfile
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from bench.common import (bench_ms, gpu_gaps, interleaved_ms, kernel_times, profiled, rel_err, result_path, table,
                          write_json)
from sonic.routing import scores

SHAPES = "16384x1536x128,32768x4096x128,32768x2048x64"  # sonic_7b's step (4 x 4096 tokens); 30B's and OLMoE's d, E


def _tiles(centring, cfg: dict | None):
    """The fused forward's tile config `cfg` (None: its own choice) for the block's duration."""
    if cfg is None:
        return contextlib.nullcontext()
    own = centring._forward_tiles
    return mock.patch.object(centring, "_forward_tiles", lambda E: {**own(E), **cfg})


def _under(centring, cfg: dict | None, fn):
    """fn, called with the tile config `cfg` standing in."""
    def call():
        with _tiles(centring, cfg):
            return fn()
    return call


def _parse_sweep(text: str) -> list[dict]:
    out = []
    for item in filter(None, text.split("/")):
        values = item.split(",")
        try:
            if len(values) not in (3, 4):
                raise ValueError
            cfg = dict(zip(("BS", "BD", "num_warps", "num_stages"), (int(v) for v in values)))
        except ValueError:
            raise SystemExit(f"--sweep {text!r}: each config is BS,BD,num_warps[,num_stages] (e.g. 64,64,4 or "
                             "64,64,4,3), '/' between them")
        out.append(cfg)
    return out


def profile_calls(fn, calls: int, cuda: bool) -> dict:
    """Each kernel's mean us per call of fn() over `calls` calls, and the GPU's idle time per call between them."""
    _, prof = profiled(lambda: [fn() for _ in range(calls)], cuda, cpu_too=cuda)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        gaps = gpu_gaps(json.loads(trace.read_text()).get("traceEvents", []), top=3)
    return {"kernels_us": {name: 1e3 * ms / calls for name, ms, _ in kernel_times(prof, cuda)},
            "idle_us": 1e3 * gaps.get("idle_ms", 0.0) / calls, "host_bound_us": 1e3 * gaps.get("idle_host_bound_ms",
                                                                                                  0.0) / calls}


def load_baseline(path: str):
    """The centring module in the file `path`, under a name of its own (its kernels compile apart from ours)."""
    if not Path(path).is_file():
        raise SystemExit(f"--baseline {path}: no such file (write one with `git show REV:sonic/kernels/triton/"
                         "centring.py > FILE`)")
    spec = importlib.util.spec_from_file_location("centring_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(T: int, D: int, E: int, S: int, sweep: list[dict], device: torch.device, profile: int = 0,
            rounds: int = 5, baseline=None) -> dict:
    from sonic.kernels.triton import centring  # noqa: PLC0415 (Triton: a GPU or its interpreter)

    if T % S:
        raise SystemExit(f"shape {T}x{D}x{E}: T={T} is not a multiple of --seq-len {S}")
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, D, generator=gen, device=device).bfloat16()
    w = (torch.randn(E, D, generator=gen, device=device) / D ** 0.5).bfloat16()
    dl = torch.randn(T, E, generator=gen, device=device)
    want, rstd64 = scores.prefix_centred_logits(x.double(), w.double(), S)
    want_dx, _ = scores.prefix_centred_logits_backward(dl.double(), x.double(), w.double(), rstd64, S)
    _, rstd = scores.prefix_centred_logits(x, w, S)
    row = {"T": T, "D": D, "E": E, "seq_len": S,
           "definition_fwd": bench_ms(lambda: scores.prefix_centred_logits(x, w, S)),
           "definition_bwd": bench_ms(lambda: scores.prefix_centred_logits_backward(dl, x, w, rstd, S)),
           "default": {"forward": centring._forward_tiles(E), "backward": centring._tiles(E)}, "configs": []}
    fns = {"linear_fwd": lambda: F.linear(x, w), "linear_bwd": lambda: (dl.bfloat16() @ w, dl.bfloat16().t() @ x)}
    errs = []
    if baseline is not None:
        got, got_rstd = baseline.prefix_centred_logits(x, w, S)
        dx, _ = baseline.prefix_centred_logits_backward(dl, x, w, got_rstd, S)
        base_err = max(rel_err(got, want), rel_err(dx, want_dx))
        fns["base_fwd"] = lambda: baseline.prefix_centred_logits(x, w, S)
        fns["base_bwd"] = lambda r=got_rstd: baseline.prefix_centred_logits_backward(dl, x, w, r, S)
    for i, cfg in enumerate([None, *sweep]):
        with _tiles(centring, cfg):
            got, got_rstd = centring.prefix_centred_logits(x, w, S)
            dx, _ = centring.prefix_centred_logits_backward(dl, x, w, got_rstd, S)
        errs.append(max(rel_err(got, want), rel_err(dx, want_dx)))
        fns[f"fwd{i}"] = _under(centring, cfg, lambda: centring.prefix_centred_logits(x, w, S))
        fns[f"bwd{i}"] = _under(centring, cfg,
                                lambda r=got_rstd: centring.prefix_centred_logits_backward(dl, x, w, r, S))
    ms = {name: statistics.median(times) for name, times in interleaved_ms(fns, {}, rounds).items()}
    row.update(linear_fwd=ms["linear_fwd"], linear_bwd=ms["linear_bwd"])
    for i, cfg in enumerate([None, *sweep]):
        row["configs"].append({"cfg": cfg or "default", "fwd": ms[f"fwd{i}"], "bwd": ms[f"bwd{i}"], "err": errs[i]})
    if baseline is not None:
        row["configs"].append({"cfg": "baseline", "fwd": ms["base_fwd"], "bwd": ms["base_bwd"], "err": base_err})
    if profile:
        cuda = device.type == "cuda"
        row["profile"] = {"fwd": profile_calls(lambda: centring.prefix_centred_logits(x, w, S), profile, cuda),
                          "bwd": profile_calls(lambda: centring.prefix_centred_logits_backward(dl, x, w, rstd, S),
                                               profile, cuda)}
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="T x D x E, comma-separated")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--sweep", default="", help="more tile configs: BS,BD,num_warps[,num_stages]/...")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the alternating timings")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="profile N calls of each direction per shape")
    ap.add_argument("--baseline", metavar="FILE", help="another centring.py, timed beside the default (an A/B)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("bench.centring runs the fused Triton kernels: on a GPU, or on the CPU with "
                         "TRITON_INTERPRET=1 (a smoke run of tiny shapes; its times mean nothing)")
    sweep = _parse_sweep(args.sweep)
    baseline = load_baseline(args.baseline) if args.baseline else None
    rows = []
    for shape in args.shapes.split(","):
        try:
            T, D, E = (int(v) for v in shape.split("x"))
        except ValueError:
            raise SystemExit(f"--shapes {shape!r}: expected T x D x E, e.g. 16384x1536x128")
        rows.append(measure(T, D, E, args.seq_len, sweep, device, args.profile, args.rounds, baseline))
    path = write_json(result_path("centring", args.json), {
        "baseline": args.baseline,
        "what": "the router's prefix-centred logits alone: fused Triton kernels, the PyTorch definition, the plain "
                "linear router", "units": "ms per call (do_bench median); err: the fused path's relative error "
                "against the definition in fp64, the larger of the logits' and dx's", "rows": rows})
    lines = []
    for r in rows:
        for c in r["configs"]:
            lines.append([f"{r['T']}x{r['D']}x{r['E']}", str(c["cfg"]), f"{c['fwd']:.3f}", f"{c['bwd']:.3f}",
                          f"{r['definition_fwd']:.3f}", f"{r['definition_bwd']:.3f}", f"{r['linear_fwd']:.3f}",
                          f"{r['linear_bwd']:.3f}", f"{c['err']:.1e}"])
    print(table(lines, ["T x D x E", "fused config", "fused fwd", "fused bwd", "def fwd", "def bwd", "linear fwd",
                        "linear bwd", "err"]))
    for r in (r for r in rows if "profile" in r):
        for way, p in r["profile"].items():
            print(f"{r['T']}x{r['D']}x{r['E']} {way}: idle {p['idle_us']:.1f} us per call "
                  f"({p['host_bound_us']:.1f} waiting for the host)")
            for name, us in sorted(p["kernels_us"].items(), key=lambda kv: -kv[1]):
                print(f"  {us:8.1f} us  {name[:90]}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
