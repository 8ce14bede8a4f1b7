"""Routing alone, per routing backend and method: the router's logits -> RoutingPlan + aux and z losses,
forward and forward+backward (a diagnostic: the MoE-block benchmark, bench.moe_block, times it inside the block).

Per (T, E, K) of Table 9b and the routing backends (torch: the semantics; triton: the fused kernels), the
Router's `route` on the same bf16 logits, with the gates' and losses' gradients flowing back to the logits,
timed with do_bench medians after warm-up. The plans are checked equal first.

Run:   python -m bench.routing [--configs 7B,30B,Qwen3-Next] [--backends torch,triton]
       python -m bench.routing --shape 256,16,4 --backends torch   (CPU smoke)
"""
from __future__ import annotations

import argparse

import torch

from bench.common import bench_ms, result_path, table, write_json
from bench.moe_configs import CONFIGS
from sonic.routing import Router, RoutingConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="7B,1.4B,30B,OLMoE,Qwen3-Next")
    ap.add_argument("--shape", help="T,E,K instead of --configs (e.g. a CPU smoke run)")
    ap.add_argument("--backends", default="torch,triton")
    ap.add_argument("--methods", default="topk,token_rounding")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records, rows = [], []
    shapes = ({args.shape: tuple(map(int, args.shape.split(",")))} if args.shape else
              {name: CONFIGS[name][:1] + CONFIGS[name][3:] for name in args.configs.split(",")})
    for name, (T, E, K) in shapes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        logits = (torch.randn(T, E, generator=gen, device=device) * 2).to(torch.bfloat16).requires_grad_()
        plans, times = {}, {}
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
        for (backend, method), (f, fb_ms) in times.items():
            first = next(p for (b, m), p in plans.items() if m == method)
            same = all(torch.equal(a, b) for a, b in zip(plans[backend, method].metadata(), first.metadata()))
            records.append({"config": name, "shape": [T, E, K], "backend": backend, "method": method, "fwd_ms": f,
                            "fb_ms": fb_ms, "plans_equal": same})
            rows.append([name, method, backend, f"{f:.3f}", f"{fb_ms:.3f}", same])
    path = write_json(result_path("routing", args.json), {"records": records})
    print(table(rows, ["config", "method", "backend", "fwd ms", "fwd+bwd ms", "plans equal (per method)"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
