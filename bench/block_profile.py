"""Where the MoE block's time goes, kernel by kernel, beside the official layer's (a diagnostic for bench.moe_block).

Per config: the block as bench.moe_block builds and times it (the --model preset's routing, bf16 autocast,
torch.compile unless --eager) and the official sonic-moe layer on the same inputs, each profiled over --iters
forward and forward+backward calls after three warm-up calls. Per profiled callable the JSON holds every
kernel's time per call (summed over its launches), its launch count, the kernels' sum and the wall time per
call (--iters back-to-back calls, not profiled); on a GPU also where it idles between kernels
(bench.common.gpu_gaps, over the --iters calls) and whether the host bounds the call (bench.common.host_bound:
issue time, syncs). On the CPU (--device cpu, reference backend, no official layer) the rows are operators' self
CPU time: a smoke test of this script.

Run:   python -m bench.block_profile [--configs 30B,7B] [--backend cute] [--no-official] [--json PATH]
       python -m bench.block_profile --device cpu --shape 64,32,16,4,2
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.common import cuda_or_exit, gpu_gaps, host_bound, kernel_times, profiled, result_path, write_json
from bench.moe_block import block_forward, block_moe_config, official_forward, sonic_block, step_fns
from bench.moe_configs import select_configs
from bench.moe_layer import Problem, load_official, official_layer


def kernel_table(fn, leaves, iters: int, cuda: bool) -> dict:
    """fn's kernels (CUDA) or operators (CPU): [{name, ms per call, launches per call}], slowest first."""
    def run():
        fn()
        for t in leaves:
            t.grad = None

    for _ in range(3):
        run()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    _, prof = profiled(lambda: [run() for _ in range(iters)], cuda)
    kernels = [{"name": n, "ms": ms / iters, "launches": calls / iters} for n, ms, calls in kernel_times(prof, cuda)]
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    sync()
    out = {"wall_ms": (time.perf_counter() - t0) * 1e3 / iters, "kernel_ms": sum(k["ms"] for k in kernels),
           "kernels": kernels}
    if cuda:  # where the wall time beyond the kernels' goes: the GPU idle between them, and whether it waited
        # on the host. A profile of its own: the host ops it records would add to key_averages' device times.
        _, traced = profiled(lambda: [run() for _ in range(iters)], cuda, cpu_too=True)
        with tempfile.TemporaryDirectory() as tmp:
            traced.export_chrome_trace(f"{tmp}/trace.json")
            gaps = gpu_gaps(json.loads(Path(tmp, "trace.json").read_text()).get("traceEvents", []), top=8)
        out["gpu_gaps"] = gaps  # over all --iters calls
        out["host"] = host_bound(run, iters)
    return out


def profile_config(shape, args, official) -> dict:
    p = Problem(*shape, device=args.device)
    cuda = p.device.type == "cuda"
    out = {"shape": list(shape)}
    moe = sonic_block(p, block_moe_config(args.model, shape, args.backend))
    if not args.eager:  # as sonic.parallel compiles each block: backends first, then compile
        moe.resolve_backends(p.device)
        moe.compile()
    fwd, fb = step_fns(block_forward(moe, p.x, cuda, args.seq_len), p.dout)
    leaves = [p.x] + list(moe.parameters())
    out["sonic_fwd"], out["sonic_fb"] = (kernel_table(f, leaves, args.iters, cuda) for f in (fwd, fb))
    del moe
    if official is not None:
        aux_coef = block_moe_config(args.model, shape, "reference").routing.aux_loss_coef
        _, module, official_leaves = official_layer(official, p)
        fwd, fb = step_fns(official_forward(module, p.x, aux_coef), p.dout)
        out["official_fwd"], out["official_fb"] = (kernel_table(f, official_leaves, args.iters, cuda)
                                                   for f in (fwd, fb))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=None, help="comma list of bench/moe_configs.py names (default: 30B)")
    ap.add_argument("--shape", action="append", default=[], metavar="T,d,n,E,K", help="an extra config")
    ap.add_argument("--backend", default=None, help="the block's expert backend (default: cute on a GPU, "
                                                      "reference on the CPU)")
    ap.add_argument("--model", default="sonic_7b", help="preset whose MoE config (routing) the block uses")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (the router's centring reads them)")
    ap.add_argument("--eager", action="store_true", help="profile the block uncompiled")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-official", action="store_true")
    ap.add_argument("--top", type=int, default=15, help="kernels printed per callable (the JSON has all)")
    ap.add_argument("--device", default="cuda", help="cpu only smoke-tests this script")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda_or_exit(args.device, "bench.block_profile")
    if args.iters < 1:
        ap.error(f"--iters {args.iters}: profile at least one call")
    args.backend = args.backend or ("cute" if args.device == "cuda" else "reference")
    official, why = (None, "--device cpu") if args.device == "cpu" else (
        (None, "--no-official") if args.no_official else load_official())
    configs = select_configs(args.configs if args.configs is not None or args.shape else "30B", args.shape, [])
    results = {}
    for name, shape in configs.items():
        results[name] = profile_config(shape, args, official)
        for what, rec in results[name].items():
            if what == "shape":
                continue
            print(f"\n== {name} {what}: wall {rec['wall_ms']:.3f} ms per call, kernels {rec['kernel_ms']:.3f} ms")
            if "gpu_gaps" in rec:
                g, h = rec["gpu_gaps"], rec["host"]
                n = args.iters
                print(f"  GPU idle {g.get('idle_ms', 0) / n:.3f} ms per call "
                      f"({g.get('idle_host_bound_ms', 0) / n:.3f} waiting for a launch); "
                      f"the CPU issues a call in {h['issue_ms']:.2f} ms, the GPU ends it at "
                      f"{h['wall_ms']:.2f}; syncs at {h['syncs']}")
                for gap in g.get("largest", [])[:4]:
                    print(f"    {gap['ms']:.3f} ms {gap['why']}: {gap['after'][:50]} -> {gap['before'][:50]}")
            for k in rec["kernels"][:args.top]:
                print(f"  {k['ms']:8.3f} ms  x{k['launches']:<4g} {k['name'][:110]}")
    path = write_json(result_path("block_profile", args.json),
                      {"model": args.model, "backend": args.backend, "compiled": not args.eager,
                       "iters": args.iters, "official_unavailable": why, "configs": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
