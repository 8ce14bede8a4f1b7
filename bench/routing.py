"""Routing alone, per routing backend and method: the router's logits -> RoutingPlan + aux and z losses,
forward and forward+backward (a diagnostic: the MoE-block benchmark, bench.moe_block, times it inside the block).

Per (T, E, K) of Table 9b and the routing backends (torch: the semantics; triton: the fused kernels), the
Router's `route` on the same bf16 logits, with the gates' and losses' gradients flowing back to the logits,
timed with do_bench medians after warm-up. The plans are checked equal first.

Run:   python -m bench.routing [--configs 7B,30B,Qwen3-Next] [--backends torch,triton]
       python -m bench.routing --shape 256,16,4 --backends torch   (CPU smoke)

--profile adds, per backend and method, the GPU time of the route's kernels per call (torch.profiler over
--profile-calls calls of the forward, and of the forward+backward), each kernel's share listed: the do_bench times
above are host-bound for most routing shapes, so they do not show what the kernels cost.

--select-tiles BT,SUB,WARPS/... adds a bounded sweep of the triton backend's top-K route (select kernel, chunk scan,
scatter: sonic/kernels/triton/routing.py), its tiles of BT tokens, SUB tiles a chunk and the select kernel's warps
standing in for `_chunks` (a benchmark-only substitution), beside the default: per config, the picks and the plan
checked equal to the default's (the gates and sums to rounding: a tile's shape sets the order of its reductions),
and the route's kernels' GPU time per call (torch.profiler over --profile-calls calls, the configs alternating
within each of 3 rounds; the median round), which do_bench would not show for kernels this short, as the host
issues them slower than the GPU runs them.
"""
from __future__ import annotations

import argparse
import statistics
from unittest import mock

import torch

from bench.common import bench_ms, kernel_times, profiled, result_path, table, write_json
from bench.moe_configs import CONFIGS
from sonic.routing import Router, RoutingConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="7B,1.4B,30B,OLMoE,Qwen3-Next")
    ap.add_argument("--shape", help="T,E,K instead of --configs (e.g. a CPU smoke run)")
    ap.add_argument("--backends", default="torch,triton")
    ap.add_argument("--methods", default="topk,token_rounding")
    ap.add_argument("--select-tiles", default="", help="BT,SUB,WARPS/... of the triton top-K route (a sweep)")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of each backend's route")
    ap.add_argument("--profile-calls", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records, rows = [], []
    shapes = ({args.shape: tuple(map(int, args.shape.split(",")))} if args.shape else
              {name: CONFIGS[name][:1] + CONFIGS[name][3:] for name in args.configs.split(",")})
    for name, (T, E, K) in shapes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        logits = (torch.randn(T, E, generator=gen, device=device) * 2).to(torch.bfloat16).requires_grad_()
        plans, times, kernels = {}, {}, {}
        for backend, method in ((b, m) for m in args.methods.split(",") for b in args.backends.split(",")):
            router = Router(8, E, K, RoutingConfig(backend=backend, method=method, aux_loss_coef=0.01,
                                                   z_loss_coef=0.001)).to(device).train()

            def fwd():
                return router.route(logits)

            def fb():
                out = router.route(logits)
                (out.plan.scores_R.square().sum() + out.loss).backward()  # any row count (token rounding)

            plans[backend, method] = fwd().plan
            times[backend, method] = (bench_ms(fwd), bench_ms(fb, grad_to_none=[logits]))
            if args.profile:
                kernels[backend, method] = {"fwd": kernel_us(fwd, args.profile_calls, device),
                                            "fb": kernel_us(fb, args.profile_calls, device, logits)}
        for (backend, method), (f, fb_ms) in times.items():
            first = next(p for (b, m), p in plans.items() if m == method)
            same = all(torch.equal(a, b) for a, b in zip(plans[backend, method].metadata(), first.metadata()))
            records.append({"config": name, "shape": [T, E, K], "backend": backend, "method": method, "fwd_ms": f,
                            "fb_ms": fb_ms, "plans_equal": same, **({"kernels": kernels[backend, method]}
                                                                    if args.profile else {})})
            rows.append([name, method, backend, f"{f:.3f}", f"{fb_ms:.3f}", same])
    sweep = [select_tiles_sweep(name, T, E, K, args.select_tiles, args.profile_calls, device)
             for name, (T, E, K) in shapes.items()] if args.select_tiles else []
    path = write_json(result_path("routing", args.json), {"records": records, "select_tiles": sweep})
    print(table(rows, ["config", "method", "backend", "fwd ms", "fwd+bwd ms", "plans equal (per method)"]))
    for r in records:
        for phase, k in r.get("kernels", {}).items():
            print(f"{r['config']} {r['method']} {r['backend']} {phase}: {k['us_per_call']:.1f} us of kernels per call")
            for name, us, n in k["top"][:12]:
                print(f"    {us:8.1f} us  x{n:<3} {name[:110]}")
    print(f"wrote {path}")


def kernel_us(fn, calls: int, device: torch.device, grad_of: torch.Tensor | None = None) -> dict:
    """fn's kernels' GPU us per call over `calls` calls (CPU ops' self time off a GPU): the total and each kernel's
    (name, us per call, launches per call), slowest first."""
    cuda = device.type == "cuda"

    def run():
        for _ in range(calls):
            fn()
            if grad_of is not None:
                grad_of.grad = None

    _, prof = profiled(run, cuda)
    top = [[name, 1e3 * ms / calls, n / calls] for name, ms, n in kernel_times(prof, cuda)]
    return {"us_per_call": sum(us for _, us, _ in top), "top": top}


def select_tiles_sweep(name: str, T: int, E: int, K: int, spec: str, calls: int, device: torch.device) -> dict:
    """The triton top-K route under each tile config of `spec` (module docstring) beside the default: whether its
    outputs equal the default's, and the median over 3 alternating rounds of its kernels' GPU us per call."""
    from sonic.kernels.triton import routing as fused

    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(T, E, generator=gen, device=device) * 2).float()
    bias = torch.zeros(E, device=device)
    default = fused._chunks(E, K)
    configs = {"default": default}
    for item in filter(None, spec.split("/")):
        bt, sub, warps = map(int, item.split(","))
        configs[item] = dict(default, BT=bt, SUB=sub, num_warps=warps)
    want = None
    runs: dict[str, list[float]] = {c: [] for c in configs}
    same: dict[str, bool] = {}
    for _ in range(3):
        for label, cfg in configs.items():
            # a benchmark-only substitution of the module's tiles, undone after each config
            with mock.patch.object(fused, "_chunks", lambda E_, K_, cfg=cfg: dict(cfg)):
                out = fused._route_impl(logits, bias, K, "softmax_topk", True)
                if want is None:
                    want = out
                # the picks and the plan exactly; the floats (gates, lse, probsum) to rounding: another tile shape
                # reduces a row, or sums the probabilities of a chunk, in another order
                ok = all(torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                         for a, b in zip(out, want))
                same[label] = same.get(label, True) and ok
                us = kernel_us(lambda: fused._route_impl(logits, bias, K, "softmax_topk", True), calls, device)
            runs[label].append(us["us_per_call"])
    rows = {label: {"config": configs[label], "us_per_call": statistics.median(us), "rounds_us": us,
                    "plan_equal": same[label]} for label, us in runs.items()}
    print(table([[name, label, f"{r['us_per_call']:.1f}", r["plan_equal"]] for label, r in rows.items()],
                ["config", "BT,SUB,WARPS", "route us (kernels)", "plan equal"]))
    return {"config": name, "shape": [T, E, K], "configs": rows}


if __name__ == "__main__":
    main()
