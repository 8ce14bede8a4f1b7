"""Routing alone, per routing backend: the router's logits -> RoutingPlan + aux and z losses, forward and
forward+backward (a diagnostic: the MoE-block benchmark, bench.moe_layer --block, times it inside the block).

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
from bench.moe_layer import CONFIGS
from sonic.routing import Router, RoutingConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="7B,1.4B,30B,OLMoE,Qwen3-Next")
    ap.add_argument("--shape", help="T,E,K instead of --configs (e.g. a CPU smoke run)")
    ap.add_argument("--backends", default="torch,triton")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records, rows = [], []
    shapes = ({args.shape: tuple(map(int, args.shape.split(",")))} if args.shape else
              {name: CONFIGS[name][:1] + CONFIGS[name][3:] for name in args.configs.split(",")})
    for name, (T, E, K) in shapes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        logits = (torch.randn(T, E, generator=gen, device=device) * 2).to(torch.bfloat16).requires_grad_()
        g = torch.randn(T * K, generator=gen, device=device)
        plans, times = {}, {}
        for backend in args.backends.split(","):
            router = Router(8, E, K, RoutingConfig(backend=backend, aux_loss_coef=0.01, z_loss_coef=0.001)).to(device)

            def fwd():
                return router.route(logits)

            def fb():
                out = router.route(logits)
                ((out.plan.scores_R * g).sum() + out.loss).backward()

            plans[backend] = fwd().plan
            times[backend] = (bench_ms(fwd), bench_ms(fb, grad_to_none=[logits]))
        first = next(iter(plans.values()))
        same = all(torch.equal(a, b) for p in plans.values() for a, b in zip(p.metadata(), first.metadata()))
        for backend, (f, fb_ms) in times.items():
            records.append({"config": name, "shape": [T, E, K], "backend": backend, "fwd_ms": f, "fb_ms": fb_ms,
                            "plans_equal": same})
            rows.append([name, backend, f"{f:.3f}", f"{fb_ms:.3f}", same])
    path = write_json(result_path("routing", args.json), {"records": records})
    print(table(rows, ["config", "backend", "fwd ms", "fwd+bwd ms", "plans equal"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
