"""Time the CuTe-DSL kernels on a SonicMoE shape against cuBLAS and the paper.

For each kernel: median time (triton do_bench), TFLOP/s, and cuBLAS (torch.matmul / bmm) on
the same FLOPs; then the whole layer forward / backward. Prints a table last and writes
JSON (with the exact command) to bench/results/<date>-<gpu>-cute.json or --out.

  python bench/cute_gemm.py --shape 7b [--tile-n down=128,up=256] [--layer] [--energy] [--official] [--out x.json]

--energy adds, per kernel and for cuBLAS's dense GEMM of equal FLOPs, the same call held back to back for a second
(bench/energy.py): ms, joules per call and per TFLOP, watts and the SM clock. do_bench times a kernel between L2
flushes; training holds the GPU at its power cap, where energy per FLOP sets the clock. With --energy, the six
kernels in sequence, as one f+b runs them, are held too ("chain").

--official adds the official sonic-moe layer's own kernel for each of ours (its custom ops, called as its layer
calls them, on the same tensors and routing), timed and, with --energy, held the same way: each row's
official_ms and vs_official (its time over ours). Its first call autotunes; QUACK_CACHE_DIR with
QUACK_CACHE_AUTOTUNING=1 keeps that between runs (bench/gpu.sh's block stage carries it).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from bench.common import write_json
from bench.energy import Nvml, NvmlUnavailable, sustained
from bench.moe_configs import CONFIGS
from bench.moe_layer import sparse_plans
from sonic.kernels.cute.selfcheck import wait_or_exit

SHAPES = {  # T, D, N, E, K: bench/moe_configs.py's configs under this script's --shape names
    "7b": CONFIGS["7B"], "7b-n512": CONFIGS["7B-E64"], "1.4b": CONFIGS["1.4B"], "30b": CONFIGS["30B"],
    "olmoe": CONFIGS["OLMoE"], "qwen3next": CONFIGS["Qwen3-Next"], "small": (4096, 512, 256, 16, 4),
    # the token-rounding sweep's two shapes (bench.moe_layer --sparse-sweep --sweep-shape T,d,n,K,E): 256 rows per
    # expert, so the weight-gradient kernels reduce over short K and write large outputs
    "sparse-e256": (16384, 4096, 1024, 256, 4), "sparse-e512": (16384, 4096, 512, 512, 8),
}
PAPER_TF = {"up": 559, "down": 485, "dh": 328}  # 7B breakdown on H100 (PAPER.md)


def guarded(fn, what: str, hang_s: float = 30.0) -> None:
    """Run fn once; end the process if the GPU has not finished after hang_s (a deadlock)."""
    fn()
    wait_or_exit(what, hang_s)


def bench(fn, warmup=25, rep=100, what: str = "") -> float:
    from triton.testing import do_bench
    guarded(fn, what)
    ms = do_bench(fn, warmup=warmup, rep=rep, return_mode="median")  # ms
    print(f"  {what}: {ms:.3f} ms", flush=True)
    return ms


def sweep_rounds(cands: list[str], rounds: int, time_fn) -> dict[str, list[float]]:
    """Per candidate, time_fn(candidate) once per round; round r starts at candidate r (mod their count), so no
    candidate always runs first, when the GPU's clocks are still settling, or last."""
    out: dict[str, list[float]] = {c: [] for c in cands}
    for r in range(rounds):
        for i in range(len(cands)):
            c = cands[(r + i) % len(cands)]
            out[c].append(time_fn(c))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--config", default="", help="per-kernel tile config, e.g. down=pp128,up=co256")
    ap.add_argument("--sweep", default="", help="configs to try per kernel, e.g. up=co256/pp128,dw1=co128/pp128")
    ap.add_argument("--rounds", type=int, default=3,
                    help="sweep rounds: each times every candidate once, in an order rotated round to round, so "
                         "clock drift over the sweep reaches every candidate alike; a candidate's time is its median")
    ap.add_argument("--only", default="", help="time only these kernels, e.g. down,dx (default: all six and the "
                                               "gather-sums)")
    ap.add_argument("--layer", action="store_true", help="also time the whole layer fwd/bwd")
    ap.add_argument("--energy", action="store_true", help="also each kernel and cuBLAS held for a second: joules per "
                                                           "call and TFLOP, watts, SM clock (NVML)")
    ap.add_argument("--official", action="store_true", help="also the official sonic-moe layer's kernel for each of "
                                                             "ours, on the same tensors")
    ap.add_argument("--plan", choices=("topk", "rounded"), default="topk",
                    help="rounded: the token-rounding plan of the same logits (counts multiples of 128, as the sparse "
                         "sweep's), to see which kernels gain from whole tiles")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: time each candidate at least once")

    from sonic.kernels.cute import ops

    T, D, N, E, K = SHAPES[args.shape]
    tn = dict(kv.split("=") for kv in args.config.split(",") if kv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    logits = torch.randn(T, E, device=dev)
    plan = sparse_plans(logits, K)[args.plan]
    R = plan.live_rows()  # a rounded plan is padded to a bound; the kernels run the live rows
    tok, off = plan.token_idx_R, plan.expert_offsets_E1
    x = torch.randn(T, D, device=dev).bfloat16()
    w1 = (torch.randn(E, 2 * N, D, device=dev) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, D, N, device=dev) / N ** 0.5).bfloat16()
    dout = torch.randn(T, D, device=dev).bfloat16()
    s = plan.scores_R.float()

    # first calls compile (timed separately), later calls are cached
    print("first calls (compile) ...", flush=True)
    t0 = time.perf_counter()
    h, a = ops.up_proj(x, w1, tok, off, cfg=tn.get("up"))
    guarded(lambda: None, "first up")
    y = ops.down_proj(a, w2, off, tok, cfg=tn.get("down"))
    guarded(lambda: None, "first down")
    dh, ap_, ds = ops.dh(dout, w2, h, s, tok, off, cfg=tn.get("dh"))
    guarded(lambda: None, "first dh")
    dxt = ops.dx_rows(dh, w1, off, tok, cfg=tn.get("dx"))
    guarded(lambda: None, "first dx")
    ops.dw1(dh, x, tok, off, E, cfg=tn.get("dw1"))
    guarded(lambda: None, "first dw1")
    ops.dw2(dout, ap_, tok, off, E, cfg=tn.get("dw2"))
    guarded(lambda: None, "first dw2")
    ops.gather_sum(y, plan.token_offsets_T1, plan.rows_by_token_R, plan.scores_R)
    ops.gather_sum(dxt, plan.token_offsets_T1, plan.rows_by_token_R)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0

    F = 2 * N
    rows = []

    def row(name, ms, flops, base_ms=None, bytes_=None):
        r = {"kernel": name, "ms": ms, "tflops": flops / ms * 1e-9 if flops else None}
        if base_ms is not None:
            r["cublas_ms"] = base_ms
            r["vs_cublas"] = base_ms / ms
        if bytes_:
            r["gbps"] = bytes_ / ms * 1e-6
        if name in PAPER_TF and args.shape == "7b":
            r["paper_tf"] = PAPER_TF[name]
        rows.append(r)

    nvml = None
    if args.energy:
        try:
            nvml = Nvml.open(torch.cuda.current_device())
        except NvmlUnavailable as e:
            raise SystemExit(f"--energy reads the GPU's energy counter through NVML: {e}") from None

    def held(fn, flops):  # --energy: fn back to back for a second, its joules per TFLOP beside
        r = sustained(fn, nvml)
        return {**r, "joules_per_tflop": r["joules_per_call"] / (flops * 1e-12)}

    # cuBLAS on equal FLOPs: one dense GEMM with M = R (same M, N, K as the grouped GEMM)
    def cublas(m, n, k, flops=None):
        A = torch.randn(m, k, device=dev).bfloat16()
        B = torch.randn(k, n, device=dev).bfloat16()
        ms = bench(lambda: A @ B)
        return ms, (held(lambda: A @ B, flops) if nvml else None)

    calls = {  # kernel -> (launch(cfg), flops, cuBLAS (m, n, k) on the same FLOPs)
        "up": (lambda c: ops.up_proj(x, w1, tok, off, cfg=c, out=(h, a)), 2 * R * F * D, (R, F, D)),
        "down": (lambda c: ops.down_proj(a, w2, off, tok, cfg=c, out=y), 2 * R * D * N, (R, D, N)),
        "dh": (lambda c: ops.dh(dout, w2, h, s, tok, off, cfg=c), 2 * R * N * D, (R, N, D)),
        "dx": (lambda c: ops.dx_rows(dh, w1, off, tok, cfg=c, out=dxt), 2 * R * D * F, (R, D, F)),
        "dw1": (lambda c: ops.dw1(dh, x, tok, off, E, cfg=c), 2 * R * F * D, (F, D, R)),
        "dw2": (lambda c: ops.dw2(dout, ap_, tok, off, E, cfg=c), 2 * R * D * N, (D, N, R)),
    }
    official, check_official = official_calls(x, w1, w2, dout, s, tok, off) if args.official else ({}, None)
    if official:  # like for like: the official kernels compute what ours do (bf16 rounding apart)
        checks = check_official()
        print("official vs ours, relative error: " + ", ".join(f"{k} {v:.1e}" for k, v in checks.items()), flush=True)
        if max(checks.values()) > 2e-2:
            raise SystemExit(f"the official kernels do not compute what ours do on these tensors: {checks}")
    sweep = {k: v.split("/") for k, v in (kv.split("=") for kv in args.sweep.split(",") if kv)}
    only = set(filter(None, args.only.split(",")))
    if only - set(calls) - {"gather_sum"}:
        raise SystemExit(f"--only {args.only!r}: kernels are {', '.join(calls)} and gather_sum")
    chosen = {}
    for name, (launch, flops, mnk) in calls.items():
        if only and name not in only:
            continue
        cands = sweep.get(name) or [tn.get(name) or str(ops.default_config(name, D, N, tok.numel() // E))]
        rounds = sweep_rounds(cands, args.rounds if len(cands) > 1 else 1,
                              lambda c: bench(lambda: launch(c), what=f"{name}/{c}"))
        times = {c: statistics.median(ms) for c, ms in rounds.items()}
        best = min(times, key=times.get)
        chosen[name] = best
        cublas_ms, cublas_held = cublas(*mnk, flops)
        row(name, times[best], flops, cublas_ms)
        rows[-1]["config"] = best
        if name in official:
            rows[-1]["official_ms"] = bench(official[name], what=f"{name}/official")
            rows[-1]["vs_official"] = rows[-1]["official_ms"] / times[best]
        if nvml:
            rows[-1]["held"] = held(lambda: launch(best), flops)
            rows[-1]["cublas_held"] = cublas_held
            if name in official:
                rows[-1]["official_held"] = held(official[name], flops)
        rows[-1]["sweep_ms"] = times
        if len(cands) > 1:
            rows[-1]["sweep_rounds_ms"] = rounds
    out = torch.empty(T, D, device=dev, dtype=torch.bfloat16)
    if not only or "gather_sum" in only:
        row("gather_sum_fwd", bench(lambda: ops.gather_sum(y, plan.token_offsets_T1, plan.rows_by_token_R,
                                                           plan.scores_R, out=out)), 0, bytes_=(R + T) * D * 2)
        row("gather_sum_bwd", bench(lambda: ops.gather_sum(dxt, plan.token_offsets_T1, plan.rows_by_token_R,
                                                           out=out)), 0, bytes_=(R + T) * D * 2)

    chain = {}
    if nvml and not only:  # the six kernels back to back, as one f+b runs them, held (ours, then official)
        chain_flops = sum(flops for _, flops, _ in calls.values())
        ours = [lambda n=n: calls[n][0](chosen[n]) for n in calls]
        chain["ours"] = held(lambda: [f() for f in ours], chain_flops)
        if official:
            chain["official"] = held(lambda: [official[n]() for n in calls], chain_flops)
            chain["ours_again"] = held(lambda: [f() for f in ours], chain_flops)

    layer = {}
    if args.layer:
        from sonic.kernels.cute.function import experts
        ops.DEFAULTS.update(chosen)  # the layer runs the fastest configs found above
        xg = x.clone().requires_grad_()
        w1g, w2g = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        sg = plan.scores_R.clone().requires_grad_()
        p2 = plan.with_scores(sg)
        fwd = bench(lambda: experts(xg, w1g, w2g, p2), what="layer fwd")
        o = experts(xg, w1g, w2g, p2)
        bwd_total = bench(lambda: torch.autograd.grad(experts(xg, w1g, w2g, p2), (xg, w1g, w2g, sg), dout),
                          what="layer fwd+bwd")
        flop = 6 * T * K * N * D
        layer = {"fwd_ms": fwd, "fwd_bwd_ms": bwd_total, "bwd_ms": bwd_total - fwd,
                 "fwd_tf": flop / fwd * 1e-9, "bwd_tf": 2 * flop / (bwd_total - fwd) * 1e-9,
                 "fwd_bwd_tf": 3 * flop / bwd_total * 1e-9}
        del o

    result = {
        "what": "cute grouped GEMM kernels", "shape": dict(zip("TDNEK", SHAPES[args.shape])),
        "name": args.shape, "plan": args.plan, "live_rows": R, "gpu": torch.cuda.get_device_name(), "rows": rows,
        "layer": layer, "chain": chain,
        "first_call_s": first_call_s, "compile_s": ops.COMPILE_LOG,
    }
    gpu = torch.cuda.get_device_name().split()[-1].lower().replace(" ", "")
    path = Path(args.out or f"bench/results/{datetime.date.today().isoformat()}-{gpu}-cute-{args.shape}.json")
    write_json(path, result)  # with the command, date and commit

    print(f"\n{args.shape} T,D,N,E,K={SHAPES[args.shape]}  R={R}  first call (compile) {first_call_s:.1f}s")
    for key, secs in ops.COMPILE_LOG:
        print(f"  compile {key}: {secs:.1f}s")
    for r in rows:
        if len(r.get("sweep_ms", {})) > 1:
            print(f"  sweep {r['kernel']}: " + ", ".join(f"{c} {ms:.3f}ms" for c, ms in r["sweep_ms"].items()))
    print(f"{'kernel':16s} {'ms':>8s} {'TF/s':>7s} {'cuBLAS ms':>10s} {'vs cuBLAS':>9s} {'paper TF':>8s} config")
    for r in rows:
        tf = f"{r['tflops']:.0f}" if r["tflops"] else f"{r.get('gbps', 0):.0f}GB/s"
        cb = f"{r['cublas_ms']:.3f}" if "cublas_ms" in r else "-"
        vs = f"{r['vs_cublas']:.2f}" if "vs_cublas" in r else "-"
        print(f"{r['kernel']:16s} {r['ms']:8.3f} {tf:>7s} {cb:>10s} {vs:>9s} {str(r.get('paper_tf', '-')):>8s} "
              f"{r.get('config', '')}")
    for r in rows:
        if "official_ms" in r:
            print(f"official {r['kernel']:6s} {r['official_ms']:.3f} ms against ours {r['ms']:.3f}: "
                  f"{r['vs_official']:.3f}x")
    for r in rows:
        if "held" in r:
            print(f"held {r['kernel']:6s} " + " | ".join(f"{who} {held_line(r[key])}" for who, key in (
                ("ours", "held"), ("cuBLAS", "cublas_held"), ("official", "official_held")) if key in r))
    for who, h in chain.items():
        print(f"held chain {who}: {held_line(h)}")
    if layer:
        print(f"layer fwd {layer['fwd_ms']:.3f} ms ({layer['fwd_tf']:.0f} TF)  bwd {layer['bwd_ms']:.3f} ms "
              f"({layer['bwd_tf']:.0f} TF)  f+b {layer['fwd_bwd_ms']:.3f} ms ({layer['fwd_bwd_tf']:.0f} TF)")


def held_line(h: dict) -> str:
    return (f"{h['ms']:.3f} ms {h['joules_per_tflop']:.2f} J/TFLOP {h['watts']:.0f} W "
            f"{h['sm_mhz_median']:.0f} MHz")


def official_calls(x, w1, w2, dout, s, tok, off) -> tuple[dict, Callable[[], dict]]:
    """The official sonic-moe layer's kernel for each of ours, through its custom ops with the arguments its layer
    passes (its weights are ours permuted as it permutes c_fc and c_proj; rows already in expert order, so its
    score scatter is the identity), on the same tensors; and a check that compares their outputs with ours."""
    try:
        from sonicmoe.functional import backward as ob, forward as of
    except Exception as err:  # noqa: BLE001
        raise SystemExit(f"--official needs the official sonic-moe package: {type(err).__name__}: {err}") from None
    from sonic.kernels.cute import ops
    R, (E, F, D), N = tok.numel(), w1.shape, w2.shape[2]
    w1o, w2o = w1.permute(1, 2, 0), w2.permute(1, 2, 0)  # (2n, d, E) and (d, n, E), as the official layer
    h, a, y = x.new_empty(R, F), x.new_empty(R, N), x.new_empty(R, D)
    dh, ap, dxt = x.new_empty(R, F), x.new_empty(R, N), x.new_empty(R, D)
    ds = torch.empty(R, device=x.device, dtype=torch.float32)
    rows = torch.arange(R, device=x.device, dtype=torch.int32)
    dw1, dw2 = torch.empty_like(w1o), torch.empty_like(w2o)
    fns = {
        "up": lambda: of._up_projection_forward(x, w1o, h, a, None, off, tok, "swiglu", False, False),
        "down": lambda: of._down_projection_forward(w2o, a, y, None, off),
        "dh": lambda: ob._down_projection_backward_act(dout, h, w2o, dh, ds, None, None, ap, s, off, tok, rows,
                                                        "swiglu"),
        "dx": lambda: ob._up_projection_backward_act(w1o, dxt, dh, None, off, True, False),
        "dw1": lambda: ob._up_projection_backward_weight(x, dw1, dh, off, tok, True, False),
        "dw2": lambda: ob._down_projection_backward_weight(dout, ap, dw2, off, tok),
    }

    def check() -> dict:
        for f in fns.values():
            f()
        h_, a_ = ops.up_proj(x, w1, tok, off)
        dh_, ap_, _ = ops.dh(dout, w2, h, s, tok, off)  # from the official h, as its dh reads it
        ours = {"h": h_, "a": a_, "y": ops.down_proj(a, w2, off, tok), "dh": dh_, "ap": ap_,
                "dx": ops.dx_rows(dh, w1, off, tok), "dw1": ops.dw1(dh, x, tok, off, E),
                "dw2": ops.dw2(dout, ap, tok, off, E)}
        theirs = {"h": h, "a": a, "y": y, "dh": dh, "ap": ap, "dx": dxt, "dw1": dw1.permute(2, 0, 1),
                  "dw2": dw2.permute(2, 0, 1)}
        return {k: ((ours[k].float() - theirs[k].float()).norm() / theirs[k].float().norm().clamp_min(1e-30)).item()
                for k in ours}

    return fns, check


if __name__ == "__main__":
    main()
