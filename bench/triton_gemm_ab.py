"""The triton backend's expert products by both of their kernels, per tile config: pointer loads, one tile per
program (`up_proj_kernel`, `varlen_m_gemm_kernel`, `varlen_k_gemm_kernel`), against the kernels that load the operands
TMA can reach by TMA (`up_proj_tma_kernel`, `varlen_m_tma_kernel`, `varlen_k_tma_kernel`: what `function` runs where
TMA can load them). dH (`dh_kernel`) has the pointer path only: a persistent version loading W2 by TMA ran 27-37%
slower (bench/results/2026-11-28-h200-triton_gemm_ab-bwd-3a3a37f.json).

    python -m bench.triton_gemm_ab --configs 7B,30B,120B --products up,down,dxt,dh,dw1,dw2

The products: the forward's up-projection (H, A) and down-projection Y = A W2_e^T; the backward's dH (dA' = dO W2_e
and its dSwiGLU epilogue), dX~ = dH W1_e and the weight gradients dW2_e = dO[pi_e]^T A'_e and dW1_e = dH_e^T X[pi_e].
Each record: config, kernel, path, tile config, round (--rounds N times each, in an order rotated by one each
round: the GPU's clock drifts over a sweep), do_bench median ms and TFLOPS, and the max error against a torch
product of the same bf16 operands (fp32 accumulation; for the up-projection, of H; for dH, of dH after the
dSwiGLU). Routing: a random top-K plan. Writes bench/results/<date>-<device>-triton_gemm_ab.json.
"""
from __future__ import annotations

import argparse
import contextlib

import torch

from bench.common import result_path, write_json
from bench.moe_configs import select_configs

CONFIGS = "7B,30B,120B"
PRODUCTS = "up,down,dxt,dh,dw1,dw2"


@contextlib.contextmanager
def forced(function, tuning, cfg, tma: bool):
    """function's launchers with this tile config on this path (the TMA path only where it can run)."""
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
    ap.add_argument("--tiles", default=None,
                    help="tile configs BMxBNxBKxWARPSxSTAGES, comma-separated (default: each product's candidates in "
                         "sonic/kernels/triton/tuning.py, of both paths)")
    ap.add_argument("--products", default=PRODUCTS, help=f"which products (default {PRODUCTS})")
    ap.add_argument("--paths", default="pointer,tma", help="which kernels: pointer, tma or both (default both)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every run this many times, each round in an order rotated by one (default 1)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (tests)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: at least 1")
    if set(args.paths.split(",")) - {"pointer", "tma"}:
        raise ValueError(f"--paths {args.paths}: choose pointer, tma or pointer,tma")
    paths = [p == "tma" for p in dict.fromkeys(args.paths.split(","))]
    import triton
    from triton.testing import do_bench

    from sonic.kernels.swiglu import dswiglu
    from sonic.kernels.triton import function, tuning
    from sonic.routing.plan import plan_from_topk

    given = args.tiles and [tuning.Config(*(int(v) for v in t.split("x"))) for t in args.tiles.split(",")]
    # tuning's kernel names, pointer path and TMA path
    tuned = {"up": ("up", "up_tma"), "down": ("down", "down_tma"), "dxt": ("dxt", "dxt_tma"), "dh": ("dh",),
             "dw1": ("dw", "dw1_tma"), "dw2": ("dw", "dw2_tma")}
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
        dout = torch.randn(T, D, device=dev, generator=gen).to(dtype)
        h = torch.randn(R, 2 * N, device=dev, generator=gen).to(dtype)
        tok, s = plan.token_idx_R.long(), plan.scores_R
        rows = lambda e: slice(off[e], off[e + 1])  # noqa: E731
        by_row = lambda f: lambda: torch.cat([f(e) for e in range(E)])  # noqa: E731
        by_expert = lambda f: lambda: torch.stack([f(e) for e in range(E)])  # noqa: E731
        dap = by_row(lambda e: dout[tok[rows(e)]].float() @ w2[e].float())
        # name: (the launcher, its product in torch, flops)
        products = {"up": (lambda: function.up_proj(x, w1, None, plan.token_idx_R, maps, key)[0],
                           by_row(lambda e: x[tok[rows(e)]].float() @ w1[e].float().T), 2 * R * 2 * N * D),
                    "down": (lambda: function.varlen_m(a, w2, 1, N, D, None, maps, "down", key),
                             by_row(lambda e: a[rows(e)].float() @ w2[e].float().T), 2 * R * N * D),
                    "dxt": (lambda: function.varlen_m(dh, w1, D, 1, D, None, maps, "dxt", key),
                            by_row(lambda e: dh[rows(e)].float() @ w1[e].float()), 2 * R * 2 * N * D),
                    "dh": (lambda: function.dh(dout, plan.token_idx_R, s, w2, None, h, maps, key)[0],
                           lambda: dswiglu(s.float()[:, None] * dap(), h.float()), 2 * R * N * D),
                    "dw1": (lambda: function.varlen_k(dh, None, x, plan.token_idx_R, plan.expert_offsets_E1, dtype,
                                                      key=key, kernel="dw1")[0],
                            by_expert(lambda e: dh[rows(e)].float().T @ x[tok[rows(e)]].float()), 2 * R * 2 * N * D),
                    "dw2": (lambda: function.varlen_k(dout, plan.token_idx_R, a, None, plan.expert_offsets_E1, dtype,
                                                      key=key, kernel="dw2")[0],
                            by_expert(lambda e: dout[tok[rows(e)]].float().T @ a[rows(e)].float()), 2 * R * N * D)}
        unknown = set(args.products.split(",")) - set(products)
        if unknown:
            raise ValueError(f"--products {args.products}: unknown {sorted(unknown)}; choose from {sorted(products)}")
        for kernel in args.products.split(","):
            run, product, flops = products[kernel]
            ref = product()
            tiles = given or dict.fromkeys(c for name in tuned[kernel] for c in tuning.CANDIDATES[name])
            runs = [(cfg, tma) for cfg in tiles for tma in (paths if len(tuned[kernel]) > 1 else [False])]  # dH: pointer
            failed = set()
            for rnd in range(args.rounds):  # each round starts one run later, so no run always goes first
                for cfg, tma in runs[rnd % len(runs):] + runs[:rnd % len(runs)]:
                    if (cfg, tma) in failed:
                        continue
                    rec = {"config": name, "shape": [T, D, N, E, K], "kernel": kernel,
                           "path": "tma" if tma else "pointer", "tile": str(cfg), "round": rnd}
                    try:
                        with forced(function, tuning, cfg, tma):
                            out = run()
                            err = (out.float() - ref).abs().max().item()
                            ms = do_bench(run, warmup=10, rep=60, return_mode="median") if dev.type == "cuda" else None
                    except triton.runtime.errors.OutOfResources as exc:  # a tile too large for this GPU: say so, go on
                        failed.add((cfg, tma))
                        records.append({**rec, "error": str(exc)})
                        print(f"{name:>8} {kernel:>4} {rec['path']:>7} {cfg} out of resources: {exc}", flush=True)
                        continue
                    rec.update(ms=ms, tflops=flops / ms / 1e9 if ms else None, max_err=err)
                    records.append(rec)
                    timed = "" if ms is None else f"{ms:.3f} ms {rec['tflops']:.0f} TF "
                    print(f"{name:>8} {kernel:>4} r{rnd} {rec['path']:>7} {cfg} {timed}err {err:.3g}", flush=True)
    path = write_json(result_path("triton_gemm_ab", args.json), {"dtype": str(dtype), "records": records})
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
