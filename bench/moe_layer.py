"""MoE layer benchmark (a diagnostic: the expert kernels alone), vs the official sonic-moe.

The main table, the block the model trains (router, routing, experts, combine) against the official
layer interleaved, is bench/moe_block.py.

Per (T, d, n, E, K): one set of bf16 inputs (x, router weight, W1, W2, dO); per backend the timed
layer is router logits (bf16 F.linear) + top-K + softmax over the picks + plan + experts, i.e.
router included, like the paper. The triton backend routes with its own kernels
(sonic.kernels.triton.routing); the other sonic backends with sonic.routing.plan.

  correctness  before timing, each backend's experts on one plan vs the fp32 reference:
               relative error of O, dX, dW1, dW2 (the official: O, dW1, dW2; its own routing)
  time         triton.testing.do_bench medians after warm-up; fwd, fwd+bwd, bwd = difference
  TFLOPS       6TKnd fwd, 12TKnd bwd, 18TKnd fwd+bwd
  held         torch.cuda.memory_allocated after the forward minus before, less the output

Here the official layer runs in-process only on --official-configs (default 7B); other rows cite
its H100 numbers (bench/moe_configs.py OFFICIAL_H100, not the same process) in a separate column.

Run:   python -m bench.moe_layer [--configs 7B,30B] [--backends triton,grouped_mm]
           [--official-configs 7B | --no-official] [--sparse-sweep] [--autotune] [--profile]
"""
from __future__ import annotations

import argparse
import gc
import time
import traceback

import torch
import torch.nn.functional as F

from bench.common import bench_ms, cuda_or_exit, held_bytes, rel_err, result_path, table, write_json
from bench.moe_configs import CONFIGS, OFFICIAL_H100, select_configs
from sonic.kernels import BACKENDS, reference
from sonic.routing.plan import plan_from_topk

SPARSE = dict(T=16384, d=1536, n=256, K=8, Es=(64, 128, 256, 512), tile=128)


class Problem:
    def __init__(self, T, d, n, E, K, seed=0, device="cuda"):
        g = torch.Generator(device=device).manual_seed(seed)
        rnd = lambda *s, std: (torch.randn(*s, generator=g, device=device) * std).to(torch.bfloat16)  # noqa: E731
        self.device = torch.device(device)
        self.shape = (T, d, n, E, K)
        self.x = rnd(T, d, std=1.0).requires_grad_()
        self.wr = rnd(E, d, std=d ** -0.5).requires_grad_()
        self.w1 = rnd(E, 2 * n, d, std=d ** -0.5).requires_grad_()
        self.w2 = rnd(E, d, n, std=n ** -0.5).requires_grad_()
        self.dout = rnd(T, d, std=1.0)

    def leaves(self):
        return [self.x, self.wr, self.w1, self.w2]


def torch_route(logits_TE, K, E):
    top, idx = logits_TE.float().topk(K, dim=-1)
    return plan_from_topk(idx, top.softmax(-1), E)


def sonic_layer(name: str, p: Problem):
    """(layer() -> out, experts(plan) -> out, leaves) for a registered backend."""
    experts = BACKENDS.load(name).experts
    T, d, n, E, K = p.shape
    if name == "triton":
        from sonic.kernels.triton.routing import route_topk
        no_bias = torch.zeros(E, device=p.x.device)
        route = lambda logits: route_topk(logits, no_bias, K, "topk_softmax", False)[1]  # noqa: E731
    else:
        route = lambda logits: torch_route(logits, K, E)  # noqa: E731

    def layer():
        return experts(p.x, p.w1, p.w2, route(F.linear(p.x, p.wr)))

    return layer, p.leaves()


def load_official():
    try:
        from sonicmoe import MoE
        from sonicmoe.enums import ActivationType
    except Exception as err:  # noqa: BLE001
        return None, f"{type(err).__name__}: {err}"
    return (MoE, ActivationType), None


def official_layer(official, p: Problem):
    MoE, ActivationType = official
    T, d, n, E, K = p.shape
    moe = MoE(num_experts=E, num_experts_per_tok=K, hidden_size=d, intermediate_size=n,
              activation_function=ActivationType.SWIGLU, add_bias=False, std=0.02)
    moe = moe.to(device=p.device, dtype=torch.bfloat16)
    with torch.no_grad():  # same weights: c_fc is (E, 2n, d) gate/up interleaved, c_proj (E, d, n)
        moe.router.weight.copy_(p.wr)
        moe.c_fc.weight.copy_(p.w1)
        moe.c_proj.weight.copy_(p.w2)
    return (lambda: moe(p.x)[0]), moe, [p.x] + list(moe.parameters())


def reference_grads(p: Problem):
    """fp32 reference O, dX, dW1, dW2 on the torch top-K plan of the bf16 router logits."""
    with torch.no_grad():
        plan = torch_route(F.linear(p.x, p.wr), p.shape[4], p.shape[3])
    x, w1, w2 = (t.detach().float().requires_grad_() for t in (p.x, p.w1, p.w2))
    out = reference.experts(x, w1, w2, plan)
    dx, dw1, dw2 = torch.autograd.grad(out, (x, w1, w2), p.dout.float())
    ref = {"out": out.detach(), "dx": dx, "dw1": dw1, "dw2": dw2}
    del out, x, w1, w2
    return plan, ref


def check_sonic(experts, p: Problem, plan, ref) -> dict:
    x, w1, w2 = (t.detach().clone().requires_grad_() for t in (p.x, p.w1, p.w2))
    o = experts(x, w1, w2, plan)
    dx, dw1, dw2 = torch.autograd.grad(o, (x, w1, w2), p.dout)
    return {k: rel_err(v, ref[k]) for k, v in (("out", o), ("dx", dx), ("dw1", dw1), ("dw2", dw2))}


def check_official(moe, p: Problem, ref) -> dict:
    x = p.x.detach().clone().requires_grad_()
    moe.zero_grad(set_to_none=True)
    o = moe(x)[0]
    o.backward(p.dout)
    res = {"out": rel_err(o, ref["out"]), "dw1": rel_err(moe.c_fc.weight.grad, ref["dw1"]),
           "dw2": rel_err(moe.c_proj.weight.grad, ref["dw2"])}
    moe.zero_grad(set_to_none=True)
    return res


def mib(held: int | None) -> str:
    return "-" if held is None else f"{held / 2**20:.0f}"


def time_layer(layer, leaves, dout, warmup, rep) -> dict:
    def fwdbwd():
        layer().backward(dout)

    fwd = bench_ms(layer, leaves, warmup, rep)
    fb = bench_ms(fwdbwd, leaves, warmup, rep)
    return {"fwd_ms": fwd, "fwdbwd_ms": fb, "bwd_ms": fb - fwd}


def tflops(shape, t) -> dict:
    T, d, n, E, K = shape
    unit = T * K * n * d / 1e9  # GFLOP per "TKnd"; ms -> TFLOPS is unit / ms
    return {"fwd_tf": 6 * unit / t["fwd_ms"], "bwd_tf": 12 * unit / t["bwd_ms"],
            "fwdbwd_tf": 18 * unit / t["fwdbwd_ms"]}


def profile_triton(layer, leaves, dout, steps=3) -> list[dict]:
    """Per-kernel GPU time (ms per fwd+bwd) of the layer, largest first (grads reset, as timed)."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        for t in leaves:
            t.grad = None
        layer().backward(dout)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": ev.key[:90], "ms": us / 1e3 / steps, "calls": ev.count // steps})
    return sorted(rows, key=lambda r: -r["ms"])[:25]


def backend_names(requested: str | None, device: str) -> list[str]:
    names = list(BACKENDS) if not requested else [b for b in requested.split(",") if b != "official"]
    ok = []
    for name in names:
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; registered: {', '.join(BACKENDS)}")
        try:
            reason = BACKENDS.load(name).unavailable_reason(torch.device(device))
        except Exception as err:  # noqa: BLE001 - a backend under construction must not stop the run
            reason = f"{type(err).__name__}: {err}"
        if reason is None:
            ok.append(name)
        else:
            print(f"[skip] backend {name}: {reason}")
    return ok


def run_config(name, shape, backends, official, run_official, args) -> dict:
    print(f"\n=== {name} (T, d, n, E, K) = {shape}", flush=True)
    p = Problem(*shape, device=args.device)
    result = {"config": name, "shape": shape, "backends": {}}
    t0 = time.time()
    plan, ref = reference_grads(p)
    print(f"reference fp32 in {time.time() - t0:.1f}s", flush=True)
    entries = [(b, "sonic") for b in backends] + ([("official", "official")] if run_official else [])
    for bname, kind in entries:
        rec = {}
        try:
            t0 = time.time()
            if kind == "sonic":
                layer, leaves = sonic_layer(bname, p)
                mod = BACKENDS.load(bname)
                rec["check"] = check_sonic(mod.experts, p, plan, ref)
            else:
                layer, moe, leaves = official_layer(official, p)
                rec["check"] = check_official(moe, p, ref)
            rec["first_call_s"] = time.time() - t0
            rec.update(time_layer(layer, leaves, p.dout, args.warmup, args.rep))
            rec.update(tflops(shape, rec))
            rec["held_bytes"] = held_bytes(layer, p.device.type == "cuda")
            if args.profile and bname == "triton":
                rec["profile"] = profile_triton(layer, leaves, p.dout)
            for t in leaves:
                t.grad = None
            worst = max(rec["check"].values())
            rec["check_ok"] = worst <= 1e-2 or (kind == "official" and worst <= 3e-2)
            print(f"{bname:>10}: f+b {rec['fwdbwd_tf']:.0f} TF  fwd {rec['fwd_tf']:.0f}  bwd {rec['bwd_tf']:.0f}"
                  f"  held {mib(rec['held_bytes'])} MiB  err {worst:.1e}  (first call {rec['first_call_s']:.1f}s)",
                  flush=True)
        except Exception as err:  # noqa: BLE001 - one failing backend must not end the run
            rec = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]}
            print(f"{bname:>10}: FAILED {rec['error'][:300]}", flush=True)
        result["backends"][bname] = rec
        gc.collect()
        torch.cuda.empty_cache()
    return result


def sparse_plans(logits_TE, K: int, tile: int = 128) -> dict:
    """The sparse sweep's two plans of the same logits: top-K, and its token-rounded plan (each expert's count
    rounded to the nearest multiple of `tile`)."""
    from sonic.routing.token_rounding import token_rounding_plan

    top, idx = logits_TE.topk(K, dim=-1)
    gates = top.softmax(-1)
    return {"topk": plan_from_topk(idx, gates, logits_TE.shape[1]),
            "rounded": token_rounding_plan(logits_TE.softmax(-1), idx, gates, tile, "nearest").plan}


def sparse_sweep(backends, sweep: dict, args) -> list[dict]:
    """Experts-only kernel time, top-K plan vs token-rounded plan (counts multiples of 128)."""
    T, d, n, K, tile = sweep["T"], sweep["d"], sweep["n"], sweep["K"], sweep["tile"]
    out = []
    for E in sweep["Es"]:
        p = Problem(T, d, n, E, K, seed=E, device=args.device)
        with torch.no_grad():
            plans = sparse_plans(F.linear(p.x, p.wr).float(), K, tile)
        counts = plans["rounded"].counts_E()
        assert bool(((counts % tile == 0) | (counts == T)).all()), "token rounding left a partial tile"
        for bname in backends:
            experts = BACKENDS.load(bname).experts
            rec = {"E": E, "backend": bname}
            for pname, plan in plans.items():
                run_f = lambda plan=plan: experts(p.x, p.w1, p.w2, plan)  # noqa: E731
                t = time_layer(run_f, [p.x, p.w1, p.w2], p.dout, args.warmup, args.rep)
                rows = plan.live_rows()  # a rounded plan is padded to a bound (sonic/routing/plan.py)
                rec[pname] = {**t, "rows": rows, "fwdbwd_tf": 18 * rows * n * d / 1e9 / t["fwdbwd_ms"]}
            rec["speedup_fwd"] = rec["topk"]["fwd_ms"] / rec["rounded"]["fwd_ms"]
            rec["speedup_bwd"] = rec["topk"]["bwd_ms"] / rec["rounded"]["bwd_ms"]
            rec["speedup_fwdbwd"] = rec["topk"]["fwdbwd_ms"] / rec["rounded"]["fwdbwd_ms"]
            print(f"sparse E={E:4d} {bname:>10}: top-K {rec['topk']['fwdbwd_ms']:.3f} ms, rounded "
                  f"{rec['rounded']['fwdbwd_ms']:.3f} ms (rows {rec['topk']['rows']} -> {rec['rounded']['rows']}), "
                  f"speedup {rec['speedup_fwdbwd']:.2f}x", flush=True)
            out.append(rec)
        del p, plans
        gc.collect()
        torch.cuda.empty_cache()
    return out


def summary(results, sweep, sweep_shape: dict) -> str:
    lines = []
    rows = []
    for r in results:
        bk = r["backends"]
        off = bk.get("official", {}).get("fwdbwd_tf")
        gmm = bk.get("grouped_mm", {}).get("fwdbwd_tf")
        cited = OFFICIAL_H100.get(tuple(r["shape"]))
        for bname, rec in bk.items():
            if "error" in rec:
                rows.append([r["config"], bname, "FAILED", "", "", "", "", "", "", rec["error"][:40]])
                continue
            f = rec["fwdbwd_tf"]
            rows.append([
                r["config"], bname, f"{rec['fwd_tf']:.0f}", f"{rec['bwd_tf']:.0f}", f"{f:.0f}",
                mib(rec["held_bytes"]),
                f"{f / off:.2f}" if off else "-",
                f"{f / cited['fwdbwd']:.2f}" if cited else "-",
                f"{f / gmm:.2f}" if gmm else "-",
                f"{max(rec['check'].values()):.1e}" + ("" if rec["check_ok"] else " BAD"),
            ])
    lines.append("TFLOPS (router included), held activation MiB; ratios of f+b TFLOPS. 'vs cited' is the "
                 "official layer's H100 figure (bench/moe_configs.py OFFICIAL_H100, not same-process)")
    lines.append(table(rows, ["config", "backend", "fwd", "bwd", "f+b", "held", "vs official", "vs cited",
                              "vs grouped_mm", "max err"]))
    if sweep:
        srows = [[s["E"], s["backend"], f"{s['topk']['fwdbwd_ms']:.3f}", f"{s['rounded']['fwdbwd_ms']:.3f}",
                  f"{s['topk']['rows']}", f"{s['rounded']['rows']}", f"{s['speedup_fwd']:.2f}",
                  f"{s['speedup_bwd']:.2f}", f"{s['speedup_fwdbwd']:.2f}"] for s in sweep]
        lines.append(f"\nsparse sweep (T, d, n, K) = ({sweep_shape['T']}, {sweep_shape['d']}, {sweep_shape['n']}, "
                     f"{sweep_shape['K']}), "
                     "experts only, top-K vs token-rounded (NR-f, tile 128)")
        lines.append(table(srows, ["E", "backend", "top-K ms", "rounded ms", "rows top-K", "rows rounded",
                                   "fwd x", "bwd x", "f+b x"]))
    return "\n".join(lines)


def add_run_options(ap: argparse.ArgumentParser, configs: str, backends: str, official: str) -> None:
    """The options both MoE benchmarks take (the layer's and bench.moe_block's); the strings name their defaults."""
    ap.add_argument("--configs", default=None,
                    help=f"comma list of {', '.join(CONFIGS)} (default: {configs}; none when --shape is given)")
    ap.add_argument("--shape", action="append", default=[], metavar="T,d,n,E,K",
                    help="an extra config (repeatable), named by its tuple")
    ap.add_argument("--backends", default=None, help=f"comma list of registered backends (default: {backends})")
    ap.add_argument("--official-configs", default=None,
                    help=f"configs on which to run the official layer in-process (default: {official})")
    ap.add_argument("--no-official", action="store_true")
    ap.add_argument("--autotune", action="store_true", help="tune the triton backend's tile configs once per shape class")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    ap.add_argument("--device", default="cuda", help="cpu only smoke-tests this script (timings meaningless)")
    ap.add_argument("--json", default=None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block", action="store_true", help=argparse.SUPPRESS)  # moved: bench.moe_block
    add_run_options(ap, "all", "all that run here", "7B")
    ap.add_argument("--sparse-sweep", action="store_true", help="token rounding vs top-K kernel time, E 64..512")
    ap.add_argument("--sweep-backends", default="triton,grouped_mm")
    ap.add_argument("--sweep-shape", default=None, metavar="T,d,n,K,E1,E2,..",
                    help=f"override the sweep (default {SPARSE})")
    ap.add_argument("--profile", action="store_true", help="per-kernel times of the triton backend")
    args = ap.parse_args(argv)
    if args.block:
        ap.error("the block benchmark is its own module now: python -m bench.moe_block (same options)")
    cuda_or_exit(args.device, "bench.moe_layer")
    configs = select_configs(args.configs, args.shape, list(CONFIGS))
    backends = backend_names(args.backends, args.device)
    if args.autotune and "triton" in backends:
        from sonic.kernels.triton import tuning
        tuning.set_autotune(True)
    sweep_shape = dict(SPARSE)
    if args.sweep_shape:
        v = [int(x) for x in args.sweep_shape.split(",")]
        sweep_shape.update(T=v[0], d=v[1], n=v[2], K=v[3], Es=tuple(v[4:]))
    official, why = (None, "--no-official") if args.no_official else load_official()
    if official is None:
        print(f"[skip] official sonic-moe: {why}")
    official_on = set((args.official_configs or "7B").split(",")) if official else set()

    path = result_path("moe_layer", args.json)
    results, sweep = [], []

    def save():  # after every config, so a run cut short still leaves its numbers
        payload = {"configs": results, "sparse_sweep": sweep,
                   "official_h100": {v["name"]: v for v in OFFICIAL_H100.values()},
                   "sweep_shape": [sweep_shape[k] for k in ("T", "d", "n", "K")],
                   "official_unavailable": why}
        if "triton" in backends:
            from sonic.kernels.triton import tuning
            payload["triton_configs"] = {"/".join(map(str, k)): vars(v) for k, v in tuning.chosen().items()}
            payload["triton_tune_log"] = [{"key": "/".join(map(str, k)), "winner": str(w), "ms": t}
                                          for k, w, t in tuning.tune_log]
        write_json(path, payload)

    for c, shape in configs.items():
        results.append(run_config(c, shape, backends, official, c in official_on, args))
        save()
    if args.sparse_sweep:
        sweep = sparse_sweep([b for b in args.sweep_backends.split(",") if b in backends], sweep_shape, args)
        save()
    print("\n" + summary(results, sweep, sweep_shape))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
