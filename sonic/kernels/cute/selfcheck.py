"""Quick on-device check of every CuTe kernel, with a hang guard.

    python -m sonic.kernels.cute.selfcheck [--shape T,D,N,E,K] [--routing uniform|skewed|empty]

Runs each kernel once on fresh random inputs with NaN-poisoned outputs, compares with an
fp32 PyTorch reference (relative Frobenius error) and prints one line per kernel. A kernel
that does not finish within --hang-s seconds ends the process with exit code 3, so a
deadlocked pipeline costs seconds, not a whole device lease.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from sonic.kernels.swiglu import dswiglu, swiglu
from sonic.routing.plan import plan_from_topk


def wait_or_exit(what: str, hang_s: float) -> None:
    """Wait for the GPU; end the process if it has not finished after hang_s (a deadlock)."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > hang_s:
            print(f"HANG {what}: not finished after {hang_s}s", flush=True)
            os._exit(3)
        time.sleep(0.002)
    torch.cuda.synchronize()


def _err(out, ref) -> float:
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def run(T, D, N, E, K, routing, hang_s, configs, seed=0) -> bool:
    from sonic.kernels.cute import ops
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    logits = torch.randn(T, E, device=dev, generator=g)
    if routing == "skewed":
        logits[:, :2] += 4.0
    elif routing == "empty":
        logits[:, torch.arange(E, device=dev) % 3 != 0] = -1e4
    top, idx = logits.topk(K, -1)
    plan = plan_from_topk(idx, torch.softmax(top, -1), E)
    R, tok, off = plan.num_rows, plan.token_idx_R, plan.expert_offsets_E1
    x = torch.randn(T, D, device=dev, generator=g).bfloat16()
    w1 = (torch.randn(E, 2 * N, D, device=dev, generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, D, N, device=dev, generator=g) / N ** 0.5).bfloat16()
    dout = torch.randn(T, D, device=dev, generator=g).bfloat16()
    s = plan.scores_R.float()
    nan = lambda *shape, dt=torch.bfloat16: torch.full(shape, float("nan"), dtype=dt, device=dev)  # noqa: E731
    segs = [(e, a, b) for e, (a, b) in enumerate(zip(off.tolist()[:-1], off.tolist()[1:]))]
    tl = tok.long()
    ok = True

    def report(name, errs):
        nonlocal ok
        worst = max(errs.values())
        good = worst < 1e-2
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {name:10s} " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()),
              flush=True)

    h, a = ops.up_proj(x, w1, tok, off, configs.get("up"), out=(nan(R, 2 * N), nan(R, N)))
    wait_or_exit("up_proj", hang_s)
    h_ref = torch.empty(R, 2 * N, device=dev)
    for e, lo, hi in segs:
        h_ref[lo:hi] = x[tl[lo:hi]].float() @ w1[e].float().T
    report("up_proj", {"H": _err(h, h_ref), "A": _err(a, swiglu(h_ref))})

    y = ops.down_proj(a, w2, off, tok, configs.get("down"), out=nan(R, D))
    wait_or_exit("down_proj", hang_s)
    y_ref = torch.empty(R, D, device=dev)
    for e, lo, hi in segs:
        y_ref[lo:hi] = a[lo:hi].float() @ w2[e].float().T
    report("down_proj", {"Y": _err(y, y_ref)})

    o = ops.gather_sum(y, plan.token_offsets_T1, plan.rows_by_token_R, plan.scores_R, out=nan(T, D))
    wait_or_exit("gather_sum", hang_s)
    o_ref = torch.zeros(T, D, device=dev).index_add_(0, tl, y.float() * s[:, None])
    report("gather_sum", {"O": _err(o, o_ref)})

    cfg = configs.get("dh")
    n_tiles = -(-N // ops.dh_tile_n(D, N, cfg))
    dh, ap, ds = ops.dh(dout, w2, h, s, tok, off, cfg, out=(nan(R, 2 * N), nan(R, N), nan(n_tiles, R, dt=torch.float32)))
    wait_or_exit("dh", hang_s)
    dap = torch.empty(R, N, device=dev)
    for e, lo, hi in segs:
        dap[lo:hi] = dout[tl[lo:hi]].float() @ w2[e].float()
    a32 = swiglu(h)
    report("dh", {"dH": _err(dh, dswiglu(s[:, None] * dap, h)), "A'": _err(ap, s[:, None] * a32),
                  "dS": _err(ds, (dap * a32).sum(-1))})

    dxt = ops.dx_rows(dh, w1, off, tok, configs.get("dx"), out=nan(R, D))
    wait_or_exit("dx", hang_s)
    dxt_ref = torch.empty(R, D, device=dev)
    for e, lo, hi in segs:
        dxt_ref[lo:hi] = dh[lo:hi].float() @ w1[e].float()
    report("dx", {"dX~": _err(dxt, dxt_ref)})

    dw1 = ops.dw1(dh, x, tok, off, E, configs.get("dw1"), out=nan(E, 2 * N, D))
    wait_or_exit("dw1", hang_s)
    dw1_ref = torch.zeros(E, 2 * N, D, device=dev)
    for e, lo, hi in segs:
        dw1_ref[e] = dh[lo:hi].float().T @ x[tl[lo:hi]].float()
    report("dw1", {"dW1": _err(dw1, dw1_ref)})

    dw2 = ops.dw2(dout, ap, tok, off, E, configs.get("dw2"), out=nan(E, D, N))
    wait_or_exit("dw2", hang_s)
    dw2_ref = torch.zeros(E, D, N, device=dev)
    for e, lo, hi in segs:
        dw2_ref[e] = dout[tl[lo:hi]].float().T @ ap[lo:hi].float()
    report("dw2", {"dW2": _err(dw2, dw2_ref)})
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", default=None, help="T,D,N,E,K (repeatable)")
    ap.add_argument("--routing", action="append", default=None)
    ap.add_argument("--hang-s", type=float, default=20.0)
    ap.add_argument("--config", default="", help="per-kernel tile config, e.g. up=pp128,dw1=pp128")
    args = ap.parse_args()
    configs = dict(kv.split("=") for kv in args.config.split(",") if kv)
    shapes = [tuple(int(v) for v in s.split(",")) for s in (args.shape or ["300,384,192,8,2"])]
    ok = True
    for shape in shapes:
        for routing in args.routing or ["uniform"]:
            print(f"-- T,D,N,E,K={shape} routing={routing} configs={configs}", flush=True)
            ok &= run(*shape, routing, args.hang_s, configs)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
