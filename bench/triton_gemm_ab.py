"""The triton backend's up-projection and varlen-M products (the down-projection Y = A W2_e^T and dX~ = dH W1_e) by
both of their kernels, per tile config: pointer loads, one tile per program (`up_proj_kernel`,
`varlen_m_gemm_kernel`), against the persistent kernels that load the weights (and the varlen-M products' contiguous
A rows) by TMA (`up_proj_tma_kernel`, `varlen_m_tma_kernel`: what `function` runs where TMA can load them).

    python -m bench.triton_gemm_ab --configs 7B,30B,120B

Each record: config, kernel, path, tile config, do_bench median ms and TFLOPS, and the max error against a torch
product of the same bf16 operands (fp32 accumulation; for the up-projection, of H). Routing: a random top-K plan. Writes
bench/results/<date>-<device>-triton_gemm_ab.json.
"""
from __future__ import annotations

import argparse
import contextlib

import torch

from bench.common import result_path, write_json
from bench.moe_configs import select_configs

CONFIGS = "7B,30B,120B"


@contextlib.contextmanager
def forced(function, tuning, cfg, tma: bool):
    """function.varlen_m with this tile config on this path (the TMA path only where it can run)."""
    choose, ok = tuning.choose, function._tma_ok
    tuning.choose = lambda kernel, key, run, adjust=lambda c: c: adjust(cfg)
    if not tma:
        function._tma_ok = lambda *t: False
    try:
        yield
    finally:
        tuning.choose, function._tma_ok = choose, ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=CONFIGS, help=f"Table 9b config names (default {CONFIGS})")
    ap.add_argument("--shape", action="append", default=[], metavar="T,d,n,E,K", help="an extra shape")
    ap.add_argument("--tiles", default="128x256x64x8x3,128x256x64x8x4,256x128x64x8x3,128x128x64x4x4",
                    help="tile configs BMxBNxBKxWARPSxSTAGES, comma-separated")
    ap.add_argument("--products", default="up,down,dxt", help="which products (default up,down,dxt)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (tests)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from triton.testing import do_bench

    from sonic.kernels.triton import function, tuning
    from sonic.routing.plan import plan_from_topk

    tiles = [tuning.Config(*(int(v) for v in t.split("x"))) for t in args.tiles.split(",")]
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the interpreter has no bf16 dot
    records = []
    for name, (T, D, N, E, K) in select_configs(args.configs, args.shape, CONFIGS.split(",")).items():
        gen = torch.Generator(device=dev).manual_seed(0)
        top, idx = torch.randn(T, E, device=dev, generator=gen).topk(K, -1)
        plan = plan_from_topk(idx, top.softmax(-1), E)
        R, off = plan.num_rows, plan.expert_offsets_E1.tolist()
        a = torch.randn(R, N, device=dev, generator=gen).to(dtype)
        dh = torch.randn(R, 2 * N, device=dev, generator=gen).to(dtype)
        w1 = (torch.randn(E, 2 * N, D, device=dev, generator=gen) * D ** -0.5).to(dtype)
        w2 = (torch.randn(E, D, N, device=dev, generator=gen) * N ** -0.5).to(dtype)
        key = function._key(a, D, N, E)
        maps = function._Maps(plan.expert_offsets_E1, R)
        x = torch.randn(T, D, device=dev, generator=gen).to(dtype)
        tok = plan.token_idx_R.long()
        products = {"up": (lambda: function.up_proj(x, w1, None, plan.token_idx_R, maps, key)[0],
                           lambda e: x[tok[off[e]:off[e + 1]]].float() @ w1[e].float().T, 2 * R * 2 * N * D),
                    "down": (lambda: function.varlen_m(a, w2, 1, N, D, None, maps, "down", key),
                             lambda e: a[off[e]:off[e + 1]].float() @ w2[e].float().T, 2 * R * N * D),
                    "dxt": (lambda: function.varlen_m(dh, w1, D, 1, D, None, maps, "dxt", key),
                            lambda e: dh[off[e]:off[e + 1]].float() @ w1[e].float(), 2 * R * 2 * N * D)}
        unknown = set(args.products.split(",")) - set(products)
        if unknown:
            raise ValueError(f"--products {args.products}: unknown {sorted(unknown)}; choose from {sorted(products)}")
        for kernel in args.products.split(","):
            run, ref_e, flops = products[kernel]
            ref = torch.cat([ref_e(e) for e in range(E)])
            for cfg in tiles:
                for tma in (False, True):
                    with forced(function, tuning, cfg, tma):
                        out = run()
                        err = (out.float() - ref).abs().max().item()
                        ms = do_bench(run, warmup=10, rep=60, return_mode="median") if dev.type == "cuda" else None
                    rec = {"config": name, "shape": [T, D, N, E, K], "kernel": kernel,
                           "path": "tma" if tma else "pointer", "tile": str(cfg), "ms": ms,
                           "tflops": flops / ms / 1e9 if ms else None, "max_err": err}
                    records.append(rec)
                    timed = "" if ms is None else f"{ms:.3f} ms {rec['tflops']:.0f} TF "
                    print(f"{name:>8} {kernel:>4} {rec['path']:>7} {cfg} {timed}err {err:.3g}", flush=True)
    path = write_json(result_path("triton_gemm_ab", args.json), {"dtype": str(dtype), "records": records})
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
