"""MoE block benchmark (the main table): the block the model trains vs the official sonic-moe, interleaved.

Table 9b's twelve configs by default. Per config, the block users run:
`sonic.models.moe.MoE(d, MoEConfig)` with the --model preset's MoE config (its routing included)
at the config's (n, E, K) and no shared expert; bf16 parameters (as FSDP hands them to the
forward) under bf16 autocast: router GEMM, routing and plan, the backend's experts, combine; the
backward includes the router loss. The official layer (router included) runs in the same
process on the same x, dO and weights, its do_bench repetitions interleaved with ours round by
round (bench.common.interleaved_ms). One record per (gpu, config, backend) goes to
bench/results/<date>-<gpu>-moe_block.json:

  rounds_ms           per timed callable (fwd, official_fwd, fb, official_fb), its ms in each round
  fwd/bwd/fb_tflops   6TKnd, 12TKnd, 18TKnd over median ms (bwd = fb - fwd)
  held_mib            memory_allocated after the forward minus before, less the output (null on CPU)
  official_*          the same for the official layer; null where it did not run
  ratio_fwd/bwd/fb    Sonic over official: the official layer's median ms over ours (above 1, Sonic is
                      faster); bwd from each side's f+b minus fwd
  best_ratio_*        the same from each side's best round (its lowest fwd and f+b ms): the official
                      layer's f+b moves a lot between rounds, so one statistic alone misleads
  load_max_over_mean  the block's routed rows per expert on the timed input, busiest over mean (1: balanced)
  floor_fwd/fb_ms     the batched-GEMM floor, timed in the same rounds: the experts' products as torch.bmm over
                      E experts of T*K/E rows each (up and down; with f+b also dH, dX~, dW1, dW2), the per-expert
                      shapes at perfectly even routing with contiguous rows, no gather, no fused epilogue, no
                      router, routing or gather-sum (the paper's cuBLAS batched-GEMM upper bound; null where E
                      does not divide T*K)
  of_floor_fwd/fb     the floor's median ms over the block's: the share of that bound the block reaches
  bound_fwd/fb        the official layer's median ms over the floor's: the most any block could show as its
                      ratio_fwd/fb if all its time were those GEMMs at cuBLAS speed
  compile_s           wall seconds of the backend's first fwd+bwd on the shape: compilation
                      included unless the triton / cute (SONIC_CUTE_CACHE_DIR) disk caches hold it
  check               relative error of O, dX, dW1, dW2 and the router's dW vs the same block on
                      the reference backend (same bf16 weights, same routing); official_err_out
                      is the official output's, where the block routes as the official layer does
                      (top-K, then softmax, on the raw router input); null for a --model whose
                      routing differs (sonic_7b centres the router's input: the block does that
                      work too, and its picks differ)

The official layer compiles and autotunes for 90-520 s per shape on its first call, so the
twelve configs with it do not fit one 10-minute call: --budget-s stops before the next config
once that many seconds have passed, and --resume keeps the records already in --json and runs
only the missing (gpu, config, backend) ones. With QUACK_CACHE_DIR set and QUACK_CACHE_AUTOTUNING=1
the official layer keeps its autotune results there and a later run on the same GPU kind reuses
them (bench/gpu.sh's block stage sets both; the payload's official_autotune_cache names the folder).
Iterate on one or two configs; run all twelve for the final table. `--device cpu` smoke-tests the
path with the reference backend and no official layer (numbers meaningless).

The bare expert layer (a diagnostic: the kernels alone) is bench/moe_layer.py.

Run:   python -m bench.moe_block [--configs 7B,30B] [--backends cute,triton] [--no-official] [--compile [only]]
           [--budget-s 540 --resume --json PATH]
       python -m bench.moe_block --device cpu --shape 64,32,16,4,2
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import time
import traceback

import torch

from bench.common import cuda_or_exit, gpu_name, held_bytes, interleaved_ms, rel_err, result_path, table, write_json
from bench.moe_configs import TABLE_9B_NAMES, select_configs
from bench.moe_layer import Problem, add_run_options, backend_names, load_official, official_layer
from sonic.models.moe import MoE
from sonic.models.presets import load_preset

RATIO_FIELDS = tuple(f"{stat}ratio_{phase}" for stat in ("", "best_") for phase in ("fwd", "bwd", "fb"))
BLOCK_FIELDS = ("gpu", "config", "backend", "fwd_tflops", "bwd_tflops", "fb_tflops", "held_mib",
                "official_fb_tflops", "official_held_mib", *RATIO_FIELDS, "compile_s", "load_max_over_mean")


def block_moe_config(model: str, shape, backend: str):
    """The preset's MoE config (routing included) at the shape's (n, E, K), no shared expert (Table 9b's layer)."""
    _, _, n, E, K = shape
    return dataclasses.replace(load_preset(model).moe, num_experts=E, top_k=K, expert_dim=n, shared_expert_dim=0,
                               kernel_backend=backend)


COMPILED = "+compile"  # a backend name with this suffix times the block under torch.compile (--compile)


def sonic_block(p: Problem, cfg):
    """sonic.models.moe.MoE on p's weights, its parameters in p's dtype (buffers stay fp32, as in training)."""
    with torch.device(p.device):
        moe = MoE(p.shape[1], cfg)
    with torch.no_grad():
        for prm in moe.parameters():
            prm.data = prm.data.to(p.x.dtype)
        moe.router.weight_ED.copy_(p.wr)
        moe.w1_EFD.copy_(p.w1)
        moe.w2_EDN.copy_(p.w2)
    return moe


def block_call(moe, x_TD, autocast: bool, seq_len: int):
    """(out_TD, RouterOutput) of one call as the trainer makes it (bf16 autocast on a GPU): on sequences of seq_len
    tokens (one sequence of T where seq_len does not divide T), which the router's input centring reads."""
    T, D = x_TD.shape
    S = seq_len if T % seq_len == 0 else T
    with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        out_BSD, routed = moe(x_TD.view(T // S, S, D))
    return out_BSD.view(T, D), routed


def block_forward(moe, x_TD, autocast: bool, seq_len: int):
    """forward() -> (out_TD, router loss) of block_call."""
    def forward():
        out_TD, routed = block_call(moe, x_TD, autocast, seq_len)
        return out_TD, routed.loss

    return forward


def load_max_over_mean(moe, x_TD, autocast: bool, seq_len: int) -> float:
    """The block's routed rows per expert on the timed input: the busiest expert's over the mean (1: balanced;
    E / K: every token on the same K experts). Timings of a collapsed routing would measure a different load."""
    with torch.no_grad():
        counts_E = block_call(moe, x_TD, autocast, seq_len)[1].counts_E.float()
    return (counts_E.max() / counts_E.mean()).item()


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
    """MiB allocated by the forward (out_TD, loss) and kept for the backward, less the output (None on CPU)."""
    held = held_bytes(forward, cuda)
    return None if held is None else held / 2**20


def block_tflops(fwd_ms: float, fb_ms: float, unit: float, prefix: str = "") -> dict:
    """ms and TFLOPS fields from median fwd and fwd+bwd ms (bwd = their difference; None if not > 0)."""
    bwd_ms = fb_ms - fwd_ms
    return {f"{prefix}fwd_ms": fwd_ms, f"{prefix}fb_ms": fb_ms, f"{prefix}bwd_ms": bwd_ms,
            f"{prefix}fwd_tflops": 6 * unit / fwd_ms, f"{prefix}fb_tflops": 18 * unit / fb_ms,
            f"{prefix}bwd_tflops": 12 * unit / bwd_ms if bwd_ms > 0 else None}


def ratios(times: dict[str, list[float]]) -> dict:
    """RATIO_FIELDS from interleaved rounds: official ms over Sonic ms for fwd, bwd (f+b minus fwd) and f+b,
    from the medians and from each side's best round; None where a bwd is not > 0 (noise on tiny shapes)."""
    out = {}
    for stat, pick in (("", statistics.median), ("best_", min)):
        fwd, fb = pick(times["fwd"]), pick(times["fb"])
        off_fwd, off_fb = pick(times["official_fwd"]), pick(times["official_fb"])
        for phase, sonic_ms, official_ms in (("fwd", fwd, off_fwd), ("bwd", fb - fwd, off_fb - off_fwd),
                                             ("fb", fb, off_fb)):
            out[f"{stat}ratio_{phase}"] = official_ms / sonic_ms if sonic_ms > 0 and official_ms > 0 else None
    return out


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


def batched_floor(p: Problem) -> dict | None:
    """{"floor_fwd", "floor_fb"} callables of the batched-GEMM floor (module docstring), or None where E does not
    divide T*K. The operands are random, in p's dtype; the f+b one reuses the row operands for dO, dH and A'."""
    T, d, n, E, K = p.shape
    if T * K % E:
        return None
    m = T * K // E
    rnd = lambda *s: torch.randn(*s, device=p.device, dtype=p.x.dtype)  # noqa: E731
    x_EMD, a_EMN, dh_EMF = rnd(E, m, d), rnd(E, m, n), rnd(E, m, 2 * n)
    w1_EFD, w2_EDN = rnd(E, 2 * n, d), rnd(E, d, n)
    h_EMF, y_EMD, dxt_EMD = dh_EMF.new_empty(E, m, 2 * n), x_EMD.new_empty(E, m, d), x_EMD.new_empty(E, m, d)
    da_EMN, dw1_EFD, dw2_EDN = a_EMN.new_empty(E, m, n), torch.empty_like(w1_EFD), torch.empty_like(w2_EDN)

    def fwd():
        torch.bmm(x_EMD, w1_EFD.transpose(1, 2), out=h_EMF)  # up: H = X W1^T
        torch.bmm(a_EMN, w2_EDN.transpose(1, 2), out=y_EMD)  # down: Y = A W2^T

    def fb():
        fwd()
        torch.bmm(x_EMD, w2_EDN, out=da_EMN)  # dH: dA' = dO W2
        torch.bmm(dh_EMF, w1_EFD, out=dxt_EMD)  # dX~ = dH W1
        torch.bmm(dh_EMF.transpose(1, 2), x_EMD, out=dw1_EFD)  # dW1 = dH^T X
        torch.bmm(x_EMD.transpose(1, 2), a_EMN, out=dw2_EDN)  # dW2 = dO^T A'

    return {"floor_fwd": fwd, "floor_fb": fb}


def floor_fields(times: dict[str, list[float]]) -> dict:
    """floor_*_ms, of_floor_* and bound_* (module docstring) from interleaved rounds' medians; bound_* None
    without the official layer's rounds."""
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {}
    for phase in ("fwd", "fb"):
        floor = med[f"floor_{phase}"]
        out |= {f"floor_{phase}_ms": floor, f"of_floor_{phase}": floor / med[phase],
                f"bound_{phase}": med[f"official_{phase}"] / floor if f"official_{phase}" in med else None}
    return out


def block_grads(moe, p: Problem, autocast: bool, seq_len: int) -> dict:
    x_TD = p.x.detach().clone().requires_grad_()
    moe.zero_grad(set_to_none=True)
    out_TD, loss = block_forward(moe, x_TD, autocast, seq_len)()
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
    routing = block_moe_config(args.model, shape, "reference").routing
    aux_coef = routing.aux_loss_coef
    routes_as_official = (routing.method, routing.order, routing.input_centring) == ("topk", "topk_softmax", "none")
    ref = None
    floor = batched_floor(p)
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
            moe = sonic_block(p, block_moe_config(args.model, shape, backend.removesuffix(COMPILED)))
            if backend.endswith(COMPILED):  # as sonic.parallel compiles each block: backends first, then compile
                moe.resolve_backends(p.device)
                moe.compile()
            forward = block_forward(moe, p.x, cuda, args.seq_len)
            fwd, fb = step_fns(forward, p.dout)
            leaves = [p.x] + list(moe.parameters())
            rec["compile_s"] = first_call_s(fb, leaves, cuda)
            if ref is None:  # the reference block's output and grads, once per config
                ref_moe = sonic_block(p, block_moe_config(args.model, shape, "reference"))
                ref = block_grads(ref_moe, p, cuda, args.seq_len)
                del ref_moe
            got = block_grads(moe, p, cuda, args.seq_len)
            rec["check"] = {k: rel_err(v, ref[k]) for k, v in got.items()}
            del got
            rec["max_err"] = max(rec["check"].values())
            rec["check_ok"] = rec["max_err"] <= 2e-2
            rec["held_mib"] = held_mib(forward, cuda)
            rec["load_max_over_mean"] = load_max_over_mean(moe, p.x, cuda, args.seq_len)
            # order within a round: ours fwd, official fwd, the floor's fwd, then the same for f+b
            fns, grad_leaves = {}, {"fwd": leaves, "fb": leaves}
            for phase, ours in (("fwd", fwd), ("fb", fb)):
                fns[phase] = ours
                if off is not None:
                    fns[f"official_{phase}"] = off[phase]
                    grad_leaves[f"official_{phase}"] = off["leaves"]
                if floor is not None:
                    fns[f"floor_{phase}"] = floor[f"floor_{phase}"]
            times = interleaved_ms(fns, grad_leaves, args.rounds, args.warmup, args.rep)
            med = {k: statistics.median(v) for k, v in times.items()}
            rec["rounds_ms"] = times
            rec.update(block_tflops(med["fwd"], med["fb"], unit))
            if off is not None:
                rec.update(block_tflops(med["official_fwd"], med["official_fb"], unit, "official_"))
                rec.update(official_held_mib=off["held_mib"], official_compile_s=off["compile_s"],
                           official_err_out=rel_err(off["out"], ref["out"]) if routes_as_official else None,
                           **ratios(times))
            if floor is not None:
                rec.update(floor_fields(times))
            for t in leaves:
                t.grad = None
            vs = (f"official f+b {rec['official_fb_tflops']:.3g}; Sonic/official median (best round): "
                  + ", ".join(f"{phase} {ratio_pair(rec, phase)}" for phase in ("f+b", "fwd", "bwd"))) \
                if off else "no official"
            floor_note = (f"  batched-GEMM floor: f+b at {rec['of_floor_fb']:.2f} of its speed, bound x "
                          f"{fmt(rec['bound_fb'], '.2f')}") if floor is not None else ""
            print(f"{backend:>10}: f+b {rec['fb_tflops']:.3g} TF  fwd {rec['fwd_tflops']:.3g}  {vs}  "
                  f"err {rec['max_err']:.1e}  (first call {rec['compile_s']:.1f}s){floor_note}", flush=True)
        except Exception as err:  # noqa: BLE001 - one failing backend must not end the run
            rec |= {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]}
            print(f"{backend:>10}: FAILED {rec['error'][:300]}", flush=True)
        del moe
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        emit(rec)


def fmt(value, spec=".3g") -> str:
    return "-" if value is None else format(value, spec)


def ratio_pair(rec: dict, phase: str) -> str:
    """'median (best round)' of one phase's ratio, e.g. '0.80 (0.85)'."""
    key = "fb" if phase == "f+b" else phase
    return f"{fmt(rec.get(f'ratio_{key}'), '.2f')} ({fmt(rec.get(f'best_ratio_{key}'), '.2f')})"


def block_summary(records) -> str:
    rows = []
    for r in records:
        if r.get("error"):
            rows.append([r["config"], r["backend"], "FAILED", *[""] * 12, r["error"][:40]])
            continue
        rows.append([r["config"], r["backend"], fmt(r["fwd_tflops"]), fmt(r["bwd_tflops"]), fmt(r["fb_tflops"]),
                     fmt(r["held_mib"], ".0f"), fmt(r["official_fb_tflops"]), fmt(r["official_held_mib"], ".0f"),
                     ratio_pair(r, "f+b"), ratio_pair(r, "fwd"), ratio_pair(r, "bwd"),
                     fmt(r.get("of_floor_fb"), ".2f"), fmt(r.get("bound_fb"), ".2f"), fmt(r["compile_s"], ".1f"),
                     fmt(r.get("load_max_over_mean"), ".2f"),
                     fmt(r["max_err"], ".1e") + ("" if r["check_ok"] else " BAD")])
    return ("MoE block (router + routing + experts + combine, as trained): TFLOPS, held MiB; official = "
            "sonic-moe in this process, interleaved; x = Sonic over official, median (best round); of floor = the "
            "batched-GEMM floor's ms over ours, bound = official's over the floor's\n"
            + table(rows, ["config", "backend", "fwd", "bwd", "f+b", "held", "official f+b", "official held",
                           "x f+b", "x fwd", "x bwd", "of floor f+b", "bound x f+b", "compile s", "load max/mean",
                           "max err"]))


def run_block(configs, args) -> None:
    if args.device == "cpu":
        official, why = None, "--device cpu"
    else:
        official, why = (None, "--no-official") if args.no_official else load_official()
    if official is None:
        print(f"[skip] official sonic-moe: {why}")
    official_on = set(configs if args.official_configs is None else args.official_configs.split(","))
    backends = backend_names(args.backends or ("cute,triton" if args.device == "cuda" else "reference"), args.device)
    if args.compile:  # each backend as the trainer runs it: the block under torch.compile (COMPILED suffix)
        backends = (backends if args.compile == "also" else []) + [b + COMPILED for b in backends]
    if args.autotune and "triton" in backends:  # as SONIC_TRITON_AUTOTUNE=1 does in training
        from sonic.kernels.triton import tuning  # noqa: PLC0415 - needs triton
        tuning.set_autotune(True)
    path = result_path("moe_block", args.json)
    records = []
    if args.resume and path.exists():
        records = [r for r in json.loads(path.read_text()).get("records", []) if not r.get("error")]
        print(f"[resume] {len(records)} records from {path}")
    done = {(r["gpu"], r["config"], r["backend"]) for r in records}
    # where the official layer keeps (and finds) its autotune results; None: it tunes afresh every run
    autotune_cache = os.environ.get("QUACK_CACHE_DIR") if os.environ.get("QUACK_CACHE_AUTOTUNING") == "1" else None

    def emit(rec):  # saved after every record, so a run cut short keeps its numbers
        records[:] = [r for r in records if (r["gpu"], r["config"], r["backend"]) != (rec["gpu"], rec["config"],
                                                                                       rec["backend"])] + [rec]
        write_json(path, {"mode": "block", "model": args.model, "records": records, "official_unavailable": why,
                          "seq_len": args.seq_len, "rounds": args.rounds, "warmup_ms": args.warmup,
                          "rep_ms": args.rep, "triton_autotune": args.autotune,
                          "official_autotune_cache": autotune_cache})

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
    add_run_options(ap, "Table 9b's twelve", "cute,triton on a GPU, reference on the CPU", "all")
    ap.add_argument("--model", default="sonic_7b", help="preset whose MoE config (routing) the block uses")
    ap.add_argument("--seq-len", type=int, default=4096,
                    help="tokens per sequence in the block's input (the router's input centring reads them; "
                         "4096 as sonic_7b trains; one sequence of T where it does not divide T)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (each a do_bench per layer)")
    ap.add_argument("--budget-s", type=float, default=0, help="start no config after this many seconds")
    ap.add_argument("--resume", action="store_true", help="keep the records in --json, run the missing ones")
    ap.add_argument("--compile", nargs="?", const="also", choices=("also", "only"), default=None,
                    help="also time each backend's block under torch.compile, as the trainer runs it "
                         "(<backend>+compile); --compile only: the compiled blocks alone")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: time at least one round (7 or more for a table)")
    if args.seq_len < 1:
        ap.error(f"--seq-len {args.seq_len}: give a positive number of tokens per sequence")
    cuda_or_exit(args.device, "bench.moe_block")
    run_block(select_configs(args.configs, args.shape, TABLE_9B_NAMES), args)


if __name__ == "__main__":
    main()
