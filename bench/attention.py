"""Causal attention by each core that can run here, at a model's attention shape: forward and forward + backward.

The cores are sonic/models/attention.py's, built as the model builds them: sdpa (torch SDPA, cuDNN's kernel on
Hopper), flex (FlexAttention, compiled) and fa4 (FlashAttention-4's kernels, sonic/kernels/fa4.py, where the
package is installed). Inputs are (B, H, S, Hd) views of (B, S, H, Hd) tensors, as the model's projections make
them. Each core's output and q, k, v gradients are checked against fp32 SDPA on the first two heads first (the
relative error of each), then the cores are timed interleaved over --rounds rounds (do_bench medians; TFLOPS count
causal attention: 2 * B * H * S^2 * Hd forward, 2.5 times that backward).

    python -m bench.attention [--shape 4,4096,24,24,64] [--cores sdpa,flex,fa4] [--rounds 5] [--json out.json]

--shape is B,S,H,G,Hd (G kv heads); the default is sonic_7b's at micro-batch 4. `--device cpu` is a smoke run of
the script itself (host-timed; cores that cannot run on a CPU are recorded with the reason). Writes
bench/results/<date>-<gpu>-attention.json (or --json) with the command, date and commit.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import cuda_or_exit, interleaved_ms, rel_err, result_path, table, write_json
from sonic.models.attention import SDPACore, build_attention_core


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4,4096,24,24,64", help="B,S,H,G,Hd")
    ap.add_argument("--cores", default="sdpa,flex,fa4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = cuda_or_exit(args.device, "bench.attention")
    B, S, H, G, Hd = (int(x) for x in args.shape.split(","))
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)

    def bshd(heads):
        return torch.randn(B, S, heads, Hd, device=dev, generator=gen, dtype=torch.bfloat16)

    q0, k0, v0, dout0 = bshd(H), bshd(G), bshd(G), bshd(H)
    with torch.enable_grad():  # the fp32 reference on two heads (of one kv group where G < H)
        h = slice(0, 2)
        kv = slice(0, 1) if G < H else h
        ref_in = [t[:, :, s].float().transpose(1, 2).requires_grad_() for t, s in ((q0, h), (k0, kv), (v0, kv))]
        ref = SDPACore(Hd)(*ref_in, None)
        ref.backward(dout0[:, :, h].float().transpose(1, 2))
        ref_out = [ref.detach()] + [t.grad for t in ref_in]

    fwds, fbs, leaves, records = {}, {}, {}, []
    for name in args.cores.split(","):
        rec = {"core": name, "shape": [B, S, H, G, Hd]}
        core = build_attention_core(name, Hd)
        q, k, v = (t.detach().clone().transpose(1, 2).requires_grad_() for t in (q0, k0, v0))
        try:
            mask = core.mask(None, S, dev)
            t0 = time.perf_counter()
            out = core(q, k, v, mask)
            out.backward(dout0.transpose(1, 2))
            if cuda:
                torch.cuda.synchronize()
            rec["first_call_s"] = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001 - a core that cannot run here is reported, the others still run
            rec["error"] = f"{type(err).__name__}: {err}"[:400]
            print(f"{name:>5}: {rec['error']}", flush=True)
            records.append(rec)
            continue
        got = [out[:, h], q.grad[:, h], k.grad[:, kv], v.grad[:, kv]]
        rec["rel_err"] = dict(zip(("out", "dq", "dk", "dv"), (rel_err(a.float(), b) for a, b in zip(got, ref_out))))
        records.append(rec)

        def fwd(core=core, q=q, k=k, v=v, mask=mask):
            with torch.no_grad():
                core(q, k, v, mask)

        def fb(core=core, q=q, k=k, v=v, mask=mask):
            core(q, k, v, mask).backward(dout0.transpose(1, 2))

        fwds[name], fbs[name], leaves[name] = fwd, fb, (q, k, v)
    times_fwd = interleaved_ms(fwds, {}, rounds=args.rounds)
    times_fb = interleaved_ms(fbs, leaves, rounds=args.rounds)
    flops = 2 * B * H * S * S * Hd  # causal: half of 4 B H S^2 Hd
    rows = []
    base = statistics.median(times_fb["sdpa"]) if "sdpa" in times_fb else None
    for rec in records:
        name = rec["core"]
        if name not in fwds:
            continue
        f, fb = statistics.median(times_fwd[name]), statistics.median(times_fb[name])
        rec |= {"fwd_ms": f, "fb_ms": fb, "bwd_ms": fb - f, "best_fwd_ms": min(times_fwd[name]),
                "best_fb_ms": min(times_fb[name]), "rounds_fwd_ms": times_fwd[name], "rounds_fb_ms": times_fb[name],
                "fwd_tflops": flops / f / 1e9, "fb_tflops": 3.5 * flops / fb / 1e9,
                "fb_over_sdpa": fb / base if base else None}
        rows.append([name, f"{f:.3f}", f"{fb:.3f}", f"{fb - f:.3f}", f"{rec['fwd_tflops']:.0f}",
                     f"{rec['fb_tflops']:.0f}", f"{rec['fb_over_sdpa']:.3f}" if base else "-",
                     f"{max(rec['rel_err'].values()):.1e}", f"{rec['first_call_s']:.1f}"])
    print(table(rows, ["core", "fwd ms", "f+b ms", "bwd ms", "fwd TF", "f+b TF", "f+b / sdpa", "max rel err",
                       "first call s"]))
    path = write_json(result_path("attention", args.json), {"shape": [B, S, H, G, Hd], "rounds": args.rounds,
                                                            "records": records})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
