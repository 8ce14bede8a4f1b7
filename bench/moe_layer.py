"""MoE layer benchmark: the training MoE block (--block) or the bare expert layer, vs the official sonic-moe.

--block (the main table: Table 9b's twelve configs by default). Per config, the block users run:
`sonic.models.moe.MoE(d, MoEConfig)` with the --model preset's MoE config (its routing included)
at the config's (n, E, K) and no shared expert; bf16 parameters (as FSDP hands them to the
forward) under bf16 autocast: router GEMM, routing and plan, the backend's experts, combine; the
backward includes the router loss. The official layer (router included) runs in the same
process on the same x, dO and weights, its do_bench repetitions interleaved with ours round by
round (bench.common.interleaved_ms). One record per (gpu, config, backend) goes to
bench/results/<date>-<gpu>-moe_block.json:

  fwd/bwd/fb_tflops   6TKnd, 12TKnd, 18TKnd over median ms (bwd = fb - fwd)
  held_mib            memory_allocated after the forward minus before, less the output (null on CPU)
  official_*          the same for the official layer; null where it did not run
  ratio_fb            fb_tflops / official_fb_tflops
  compile_s           wall seconds of the backend's first fwd+bwd on the shape: compilation
                      included unless the triton / cute (SONIC_CUTE_CACHE_DIR) disk caches hold it
  check               relative error of O, dX, dW1, dW2 and the router's dW vs the same block on
                      the reference backend (same bf16 weights, same routing); official_err_out
                      is the official output's

The official layer compiles and autotunes for 90-520 s per shape on its first call, so the
twelve configs with it do not fit one 10-minute call: --budget-s stops before the next config
once that many seconds have passed, and --resume keeps the records already in --json and runs
only the missing (gpu, config, backend) ones. `--device cpu` smoke-tests the path with the
reference backend and no official layer (numbers meaningless).

Without --block (diagnostic: the expert kernels alone). Per (T, d, n, E, K): one set of bf16
inputs (x, router weight, W1, W2, dO); per backend the timed layer is router logits (bf16
F.linear) + top-K + softmax over the picks + plan + experts, i.e. router included, like the
paper. The triton backend routes with its own kernels (sonic.kernels.triton.routing); the other
sonic backends with sonic.routing.plan.

  correctness  before timing, each backend's experts on one plan vs the fp32 reference:
               relative error of O, dX, dW1, dW2 (the official: O, dW1, dW2; its own routing)
  time         triton.testing.do_bench medians after warm-up; fwd, fwd+bwd, bwd = difference
  TFLOPS       6TKnd fwd, 12TKnd bwd, 18TKnd fwd+bwd
  held         torch.cuda.memory_allocated after the forward minus before, less the output

Here the official layer runs in-process only on --official-configs (default 7B); other rows cite
its H100 numbers (bench/moe_configs.py OFFICIAL_H100, not the same process) in a separate column.

Run:   python -m bench.moe_layer --block [--configs 7B,30B] [--backends cute,triton] [--no-official]
           [--budget-s 540 --resume --json PATH]
       python -m bench.moe_layer --block --device cpu --shape 64,32,16,4,2
       python -m bench.moe_layer [--configs 7B,30B] [--backends triton,grouped_mm]
           [--official-configs 7B | --no-official] [--sparse-sweep] [--autotune] [--profile]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

from bench.common import bench_ms, gpu_name, interleaved_ms, rel_err, result_path, table, write_json
from bench.moe_configs import CONFIGS, OFFICIAL_H100, TABLE_9B_NAMES, select_configs
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
        route = lambda logits: route_topk(logits, K)  # noqa: E731
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


def held_bytes(layer) -> int:
    if not torch.cuda.is_available():
        return 0
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = layer()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    del out
    return held


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
            rec["held_bytes"] = held_bytes(layer)
            if args.profile and bname == "triton":
                rec["profile"] = profile_triton(layer, leaves, p.dout)
            for t in leaves:
                t.grad = None
            worst = max(rec["check"].values())
            rec["check_ok"] = worst <= 1e-2 or (kind == "official" and worst <= 3e-2)
            print(f"{bname:>10}: f+b {rec['fwdbwd_tf']:.0f} TF  fwd {rec['fwd_tf']:.0f}  bwd {rec['bwd_tf']:.0f}"
                  f"  held {rec['held_bytes'] / 2**20:.0f} MiB  err {worst:.1e}  (first call {rec['first_call_s']:.1f}s)",
                  flush=True)
        except Exception as err:  # noqa: BLE001 - one failing backend must not end the run
            rec = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]}
            print(f"{bname:>10}: FAILED {rec['error'][:300]}", flush=True)
        result["backends"][bname] = rec
        gc.collect()
        torch.cuda.empty_cache()
    return result


def sparse_sweep(backends, sweep: dict, args) -> list[dict]:
    """Experts-only kernel time, top-K plan vs token-rounded plan (counts multiples of 128)."""
    from sonic.routing.token_rounding import token_rounding_plan

    T, d, n, K, tile = sweep["T"], sweep["d"], sweep["n"], sweep["K"], sweep["tile"]
    out = []
    for E in sweep["Es"]:
        p = Problem(T, d, n, E, K, seed=E, device=args.device)
        with torch.no_grad():
            logits = F.linear(p.x, p.wr).float()
            top, idx = logits.topk(K, dim=-1)
            gates = top.softmax(-1)
            plans = {"topk": plan_from_topk(idx, gates, E),
                     "rounded": token_rounding_plan(logits.softmax(-1), idx, gates, tile, "nearest").plan}
        counts = plans["rounded"].counts_E()
        assert bool(((counts % tile == 0) | (counts == T)).all()), "token rounding left a partial tile"
        for bname in backends:
            experts = BACKENDS.load(bname).experts
            rec = {"E": E, "backend": bname}
            for pname, plan in plans.items():
                run_f = lambda plan=plan: experts(p.x, p.w1, p.w2, plan)  # noqa: E731
                t = time_layer(run_f, [p.x, p.w1, p.w2], p.dout, args.warmup, args.rep)
                rows = plan.num_rows
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
                f"{rec['held_bytes'] / 2**20:.0f}",
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


# ---------------------------------------------------------------- --block: the training MoE block

BLOCK_FIELDS = ("gpu", "config", "backend", "fwd_tflops", "bwd_tflops", "fb_tflops", "held_mib",
                "official_fb_tflops", "official_held_mib", "ratio_fb", "compile_s")


def block_moe_config(model: str, shape, backend: str):
    """The preset's MoE config (routing included) at the shape's (n, E, K), no shared expert (Table 9b's layer)."""
    from sonic.models.presets import load_preset  # noqa: PLC0415 - needs omegaconf; layer mode does not

    _, _, n, E, K = shape
    return dataclasses.replace(load_preset(model).moe, num_experts=E, top_k=K, expert_dim=n, shared_expert_dim=0,
                               kernel_backend=backend)


def sonic_block(p: Problem, cfg):
    """sonic.models.moe.MoE on p's weights, its parameters in p's dtype (buffers stay fp32, as in training)."""
    from sonic.models.moe import MoE  # noqa: PLC0415

    with torch.device(p.device):
        moe = MoE(p.shape[1], cfg)
    with torch.no_grad():
        for prm in moe.parameters():
            prm.data = prm.data.to(p.x.dtype)
        moe.router.weight_ED.copy_(p.wr)
        moe.w1_EFD.copy_(p.w1)
        moe.w2_EDN.copy_(p.w2)
    return moe


def block_forward(moe, x_TD, autocast: bool):
    """forward() -> (out_TD, router loss), as the trainer calls the block (bf16 autocast on a GPU)."""
    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            out_TD, routed = moe(x_TD)
        return out_TD, routed.loss

    return forward


def official_forward(module, x_TD, aux_coef: float):
    """forward() -> (out_TD, aux_coef * aux loss) of the official layer."""
    def forward():
        out_TD, aux = module(x_TD)
        return out_TD, aux_coef * aux

    return forward


def step_fns(forward, dout_TD):
    """(fwd, fwd+bwd) callables for timing; the backward takes dO and the loss's own gradient."""
    def fwd_bwd():
        out_TD, loss = forward()
        torch.autograd.backward([out_TD, loss], [dout_TD, None])

    return (lambda: forward()[0]), fwd_bwd


def first_call_s(fwd_bwd, leaves, cuda: bool) -> float:
    """Wall seconds of one fwd+bwd: on a fresh shape, mostly compilation."""
    t0 = time.perf_counter()
    fwd_bwd()
    if cuda:
        torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    return time.perf_counter() - t0


def held_mib(forward, cuda: bool) -> float | None:
    """MiB allocated by the forward and kept for the backward, less the output (None on CPU)."""
    if not cuda:
        return None
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out_TD, loss = forward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out_TD.numel() * out_TD.element_size()
    del out_TD, loss
    return held / 2**20


def block_tflops(fwd_ms: float, fb_ms: float, unit: float, prefix: str = "") -> dict:
    """ms and TFLOPS fields from median fwd and fwd+bwd ms (bwd = their difference; None if not > 0)."""
    bwd_ms = fb_ms - fwd_ms
    return {f"{prefix}fwd_ms": fwd_ms, f"{prefix}fb_ms": fb_ms, f"{prefix}bwd_ms": bwd_ms,
            f"{prefix}fwd_tflops": 6 * unit / fwd_ms, f"{prefix}fb_tflops": 18 * unit / fb_ms,
            f"{prefix}bwd_tflops": 12 * unit / bwd_ms if bwd_ms > 0 else None}


def setup_official(official, p: Problem, aux_coef: float, cuda: bool) -> dict:
    """The official layer on p's weights: fwd / fb callables, leaves, first-call s, held MiB, output."""
    _, module, leaves = official_layer(official, p)
    forward = official_forward(module, p.x, aux_coef)
    off = {"leaves": leaves}
    off["fwd"], off["fb"] = step_fns(forward, p.dout)
    off["compile_s"] = first_call_s(off["fb"], leaves, cuda)
    off["held_mib"] = held_mib(forward, cuda)
    with torch.no_grad():
        off["out"] = module(p.x)[0]
    print(f"{'official':>10}: first call {off['compile_s']:.1f}s, held {off['held_mib'] or 0:.0f} MiB", flush=True)
    return off


def block_grads(moe, p: Problem, autocast: bool) -> dict:
    x_TD = p.x.detach().clone().requires_grad_()
    moe.zero_grad(set_to_none=True)
    out_TD, loss = block_forward(moe, x_TD, autocast)()
    torch.autograd.backward([out_TD, loss], [p.dout, None])
    grads = {"out": out_TD.detach(), "dx": x_TD.grad, "dw1": moe.w1_EFD.grad, "dw2": moe.w2_EDN.grad,
             "drouter": moe.router.weight_ED.grad}
    moe.zero_grad(set_to_none=True)
    return grads


def run_block_config(name, shape, backends, official, args, done, emit) -> None:
    """Every backend's block on one config, each timed interleaved with the official layer; emit(record)."""
    print(f"\n=== {name} (T, d, n, E, K) = {shape}  [block, {args.model} routing]", flush=True)
    T, d, n, E, K = shape
    unit = T * K * n * d / 1e9  # GFLOP per "TKnd"; ms -> TFLOPS is unit / ms
    gpu = gpu_name()
    todo = [b for b in backends if (gpu, name, b) not in done]
    for b in set(backends) - set(todo):
        print(f"{b:>10}: already in the results (--resume)")
    if not todo:
        return
    p = Problem(*shape, device=args.device)
    cuda = p.device.type == "cuda"
    aux_coef = block_moe_config(args.model, shape, "reference").routing.aux_loss_coef
    ref = None
    off, off_err = None, None
    if official is not None:
        try:
            off = setup_official(official, p, aux_coef, cuda)
        except Exception as err:  # noqa: BLE001 - the sonic rows still run
            off, off_err = None, f"{type(err).__name__}: {err}"
            print(f"{'official':>10}: FAILED {off_err[:300]}", flush=True)
    for backend in todo:
        rec = dict.fromkeys(BLOCK_FIELDS) | {"gpu": gpu, "config": name, "backend": backend, "shape": list(shape),
                                             "model": args.model, "official_error": off_err}
        moe = None
        try:
            moe = sonic_block(p, block_moe_config(args.model, shape, backend))
            forward = block_forward(moe, p.x, autocast=cuda)
            fwd, fb = step_fns(forward, p.dout)
            leaves = [p.x] + list(moe.parameters())
            rec["compile_s"] = first_call_s(fb, leaves, cuda)
            if ref is None:  # the reference block's output and grads, once per config
                ref_moe = sonic_block(p, block_moe_config(args.model, shape, "reference"))
                ref = block_grads(ref_moe, p, cuda)
                del ref_moe
            got = block_grads(moe, p, cuda)
            rec["check"] = {k: rel_err(v, ref[k]) for k, v in got.items()}
            del got
            rec["max_err"] = max(rec["check"].values())
            rec["check_ok"] = rec["max_err"] <= 2e-2
            rec["held_mib"] = held_mib(forward, cuda)
            fns, grad_leaves = {"fwd": fwd, "fb": fb}, {"fwd": leaves, "fb": leaves}
            if off is not None:  # order within a round: ours fwd, official fwd, ours fb, official fb
                fns = {"fwd": fwd, "official_fwd": off["fwd"], "fb": fb, "official_fb": off["fb"]}
                grad_leaves |= {"official_fwd": off["leaves"], "official_fb": off["leaves"]}
            times = interleaved_ms(fns, grad_leaves, args.rounds, args.warmup, args.rep)
            med = {k: statistics.median(v) for k, v in times.items()}
            rec["rounds_ms"] = times
            rec.update(block_tflops(med["fwd"], med["fb"], unit))
            if off is not None:
                rec.update(block_tflops(med["official_fwd"], med["official_fb"], unit, "official_"))
                rec.update(official_held_mib=off["held_mib"], official_compile_s=off["compile_s"],
                           official_err_out=rel_err(off["out"], ref["out"]),
                           ratio_fb=rec["fb_tflops"] / rec["official_fb_tflops"])
            for t in leaves:
                t.grad = None
            vs = f"official f+b {rec['official_fb_tflops']:.3g}, ratio {rec['ratio_fb']:.2f}" if off else "no official"
            print(f"{backend:>10}: f+b {rec['fb_tflops']:.3g} TF  fwd {rec['fwd_tflops']:.3g}  {vs}  "
                  f"err {rec['max_err']:.1e}  (first call {rec['compile_s']:.1f}s)", flush=True)
        except Exception as err:  # noqa: BLE001 - one failing backend must not end the run
            rec |= {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]}
            print(f"{backend:>10}: FAILED {rec['error'][:300]}", flush=True)
        del moe
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        emit(rec)


def block_summary(records) -> str:
    f = lambda v, spec=".3g": "-" if v is None else format(v, spec)  # noqa: E731
    rows = []
    for r in records:
        if r.get("error"):
            rows.append([r["config"], r["backend"], "FAILED", "", "", "", "", "", "", "", r["error"][:40]])
            continue
        rows.append([r["config"], r["backend"], f(r["fwd_tflops"]), f(r["bwd_tflops"]), f(r["fb_tflops"]),
                     f(r["held_mib"], ".0f"), f(r["official_fb_tflops"]), f(r["official_held_mib"], ".0f"),
                     f(r["ratio_fb"], ".2f"),
                     f(r["compile_s"], ".1f"), f(r["max_err"], ".1e") + ("" if r["check_ok"] else " BAD")])
    return ("MoE block (router + routing + experts + combine, as trained): TFLOPS, held MiB; official = "
            "sonic-moe in this process, interleaved\n"
            + table(rows, ["config", "backend", "fwd", "bwd", "f+b", "held", "official f+b", "official held",
                           "ratio f+b", "compile s", "max err"]))


def run_block(configs, args) -> None:
    if args.device == "cpu":
        official, why = None, "--device cpu"
    else:
        official, why = (None, "--no-official") if args.no_official else load_official()
    if official is None:
        print(f"[skip] official sonic-moe: {why}")
    official_on = set(configs if args.official_configs is None else args.official_configs.split(","))
    backends = backend_names(args.backends or ("cute,triton" if args.device == "cuda" else "reference"), args.device)
    if args.autotune and "triton" in backends:  # as SONIC_TRITON_AUTOTUNE=1 does in training
        from sonic.kernels.triton import tuning
        tuning.set_autotune(True)
    path = result_path("moe_block", args.json)
    records = []
    if args.resume and path.exists():
        records = [r for r in json.loads(path.read_text()).get("records", []) if not r.get("error")]
        print(f"[resume] {len(records)} records from {path}")
    done = {(r["gpu"], r["config"], r["backend"]) for r in records}

    def emit(rec):  # saved after every record, so a run cut short keeps its numbers
        records[:] = [r for r in records if (r["gpu"], r["config"], r["backend"]) != (rec["gpu"], rec["config"],
                                                                                       rec["backend"])] + [rec]
        write_json(path, {"mode": "block", "model": args.model, "records": records, "official_unavailable": why,
                          "rounds": args.rounds, "warmup_ms": args.warmup, "rep_ms": args.rep,
                          "triton_autotune": args.autotune})

    t0 = time.time()
    for c, shape in configs.items():
        if args.budget_s and time.time() - t0 > args.budget_s:
            print(f"[budget] {time.time() - t0:.0f}s > --budget-s {args.budget_s}: stopping before {c}; "
                  f"run again with --resume --json {path}")
            break
        run_block_config(c, shape, backends, official if c in official_on else None, args, done, emit)
    print("\n" + block_summary(records))
    print(f"\nwrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block", action="store_true",
                    help="benchmark sonic.models.moe.MoE as trained, vs the official layer interleaved (the main table)")
    ap.add_argument("--configs", default=None,
                    help=f"comma list of {', '.join(CONFIGS)} (default: Table 9b's twelve with --block, all without; "
                         "none when --shape is given)")
    ap.add_argument("--backends", default=None, help="comma list of registered backends (default: --block cute,triton "
                    "on a GPU, reference on the CPU; otherwise all that run here)")
    ap.add_argument("--official-configs", default=None,
                    help="configs on which to run the official layer in-process (default: all with --block, else 7B)")
    ap.add_argument("--no-official", action="store_true")
    ap.add_argument("--model", default="sonic_7b", help="--block: preset whose MoE config (routing) the block uses")
    ap.add_argument("--rounds", type=int, default=5, help="--block: interleaved rounds (each a do_bench per layer)")
    ap.add_argument("--budget-s", type=float, default=0, help="--block: start no config after this many seconds")
    ap.add_argument("--resume", action="store_true", help="--block: keep the records in --json, run the missing ones")
    ap.add_argument("--sparse-sweep", action="store_true", help="token rounding vs top-K kernel time, E 64..512")
    ap.add_argument("--sweep-backends", default="triton,grouped_mm")
    ap.add_argument("--sweep-shape", default=None, metavar="T,d,n,K,E1,E2,..",
                    help=f"override the sweep (default {SPARSE})")
    ap.add_argument("--autotune", action="store_true", help="tune the triton backend's tile configs once per shape class")
    ap.add_argument("--profile", action="store_true", help="per-kernel times of the triton backend")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    ap.add_argument("--shape", action="append", default=[], metavar="T,d,n,E,K",
                    help="an extra config (repeatable), named by its tuple")
    ap.add_argument("--device", default="cuda", help="cpu only smoke-tests this script (timings meaningless)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.moe_layer needs a CUDA GPU (or --device cpu for a smoke test)")
    configs = select_configs(args.configs, args.shape, TABLE_9B_NAMES if args.block else list(CONFIGS))
    if args.block:
        return run_block(configs, args)
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
