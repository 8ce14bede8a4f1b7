"""Where one training step's time goes: forward, backward, clip and optimizer, and the top kernels.

    python -m bench.train_step [--model sonic_7b] [--layers 4] [--backend triton] [--batch 4x4096]

The step is the trainer's on one GPU (bf16 autocast; bf16 weights with fp32 masters in triton's AdamW, or fp32
weights with --param-dtype fp32; the model's LM head + loss backend, grad clipping, AdamW), on random tokens.
Phases are timed with CUDA events (median of --steps after --warmup), and on a GPU each is asked whether the CPU
issuing it is the bound (`host`: issue time against wall time, and the cudaMalloc/cudaFree calls). The clip and
the optimizer step are timed as the trainer runs them, for each AdamW implementation of optim.implementation
asked for (--optimizers, on the same gradients): foreach clips the gradients in place first; fused and triton
take the clip as a divisor in their step. Each keeps its own state (`--optimizers fused` for one: the 40-layer
sonic_7b holds only one on an H200). Then one step under torch.profiler lists the CUDA kernels that take the
most time, and one more, its host calls traced too, says where the GPU idles and whether it waited there for the
host to launch the next kernel (`gpu_gaps`: the step's idle time, and the kernels it idles before). Writes
--json (default bench/results/<date>-<gpu>-train_step.json).
`--device cpu` smoke-tests the script (fp32, wall-clock timings, CPU operators: meaningless numbers).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

import torch

from bench.common import (cuda_or_exit, gpu_gaps, host_bound, kernel_times, median_ms, profiled, result_path,
                          write_json)
from sonic.models import flops_per_token
from sonic.models.presets import load_preset
from sonic.models.moe import MoE
from sonic.models.transformer import Transformer
from sonic.train.optim import TritonAdamW, clip_grad_norm, optimizer_step, takes_grad_scale

OPTIMIZERS = ("foreach", "fused", "triton")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="sonic_7b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--backend", default="triton", help="model.moe.kernel_backend")
    ap.add_argument("--routing", default=None, help="model.moe.routing.method (default: the preset's)")
    ap.add_argument("--batch", default="4x4096", help="micro-batch x sequence length")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=25, help="kernels listed from the profile")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block, as parallel.compile")
    ap.add_argument("--optimizers", default=None,
                    help=f"AdamW implementations timed, comma-separated, of {','.join(OPTIMIZERS)} (each keeps its "
                         "own state: one fits the 40-layer sonic_7b on an H200, two do not; triton needs CUDA). "
                         "Default: triton with --param-dtype bf16, else foreach,fused")
    ap.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp32"),
                    help="the weights' dtype on the GPU, as the trainer's parallel.param_dtype on one GPU: bf16 "
                         "holds them in bf16 with fp32 masters in triton's AdamW; fp32 keeps them fp32 under autocast")
    ap.add_argument("--device", default="cuda", help="cpu only smoke-tests this script (timings meaningless)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = cuda_or_exit(args.device, "bench.train_step")
    B, S = (int(v) for v in args.batch.split("x"))
    masters = cuda and args.param_dtype == "bf16"  # the trainer's weights_dtype on one GPU
    impls = (args.optimizers or ("triton" if masters else "foreach,fused")).split(",")
    if not impls or any(i not in OPTIMIZERS for i in impls):
        raise SystemExit(f"--optimizers {args.optimizers!r}: a comma-separated subset of {','.join(OPTIMIZERS)}")
    if masters and impls != ["triton"]:
        raise SystemExit("--param-dtype bf16 keeps fp32 masters in triton's AdamW only: --optimizers triton, or "
                         "--param-dtype fp32 to time torch's")
    if "triton" in impls and not cuda:
        raise SystemExit("--optimizers triton needs a CUDA GPU")
    moe_overrides = {"kernel_backend": args.backend}
    if args.routing:
        moe_overrides["routing"] = {"method": args.routing}
    cfg = load_preset(args.model, num_layers=args.layers, moe=moe_overrides)
    model = Transformer(cfg).to(args.device)
    model.init_weights(seed=0)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.resolve_backends(moe.w1_EFD.device)  # before the first compiled forward (cuda:0, as tensors say)
    if args.compile:
        for block in model.layers:
            block.compile()
    params = [p for p in model.parameters() if p.requires_grad]
    tokens = torch.randint(0, cfg.vocab_size, (B, S + 1), device=args.device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
            out = model(inputs, labels_BS=labels)  # the model's loss backend (model.loss_backend)
        return out.loss + out.router_loss

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        forward().backward()

    optimizers = {impl: (TritonAdamW(params, lr=1e-4, weight_decay=0.1, compute_dtype=torch.bfloat16 if masters
                                     else None) if impl == "triton" else
                         torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **{impl: True})) for impl in impls}
    fwd_bwd()
    for opt in optimizers.values():
        opt.step()  # creates the state, so the timed steps are steady-state ones

    def clip_and_step(opt):
        """The trainer's: clip to 1.0 (in place, or as the step's divisor), then the AdamW step."""
        _, grad_scale = clip_grad_norm(params, 1.0, scale_in_step=takes_grad_scale(opt))
        optimizer_step(opt, grad_scale)

    phases = {"forward (model + loss)": forward, "forward + backward": fwd_bwd,
              "clip_grad_norm (in place)": lambda: clip_grad_norm(params, 1.0)}
    phases.update({f"clip + AdamW step, {impl}": (lambda opt=opt: clip_and_step(opt)) for impl, opt in optimizers.items()})
    ms = {}
    for name, fn in phases.items():
        with torch.no_grad() if name.startswith("forward (") else torch.enable_grad():
            ms[name] = median_ms(fn, args.steps, args.warmup, cuda)
    tokens_per_step = B * S
    step_ms = {impl: ms["forward + backward"] + ms[f"clip + AdamW step, {impl}"] for impl in optimizers}
    fpt = flops_per_token(cfg, S)
    print(f"{args.model} cut to {args.layers} layers, backend {args.backend}, routing {cfg.moe.routing.method}, "
          f"{B}x{S} tokens, "
          f"{torch.cuda.get_device_name() if cuda else 'CPU'}")
    for name, v in ms.items():
        print(f"  {name:>26}: {v:8.2f} ms")
    summary = {}
    for impl, v in step_ms.items():
        tps = tokens_per_step / v * 1e3
        summary[impl] = {"step_ms": v, "tokens_per_s": tps, "tflops": tps * fpt / 1e12}
        print(f"  step with {impl:>7} AdamW: {v:8.2f} ms = {tps / 1e3:.1f}k tokens/s, "
              f"{tps * fpt / 1e12:.0f} TFLOP/s by our FLOPs/token")

    host = {}
    if cuda:  # is the step bound by the CPU issuing it? (print before the profile: it is the question asked first)
        host = {name: host_bound(fn, args.steps) for name, fn in
                (("forward + backward", fwd_bwd), (f"clip + AdamW step, {impls[0]}", lambda: clip_and_step(
                    optimizers[impls[0]])))}
        for name, h in host.items():
            print(f"  {name:>26}: CPU issues it in {h['issue_ms']:.1f} ms, the GPU ends at {h['wall_ms']:.1f} ms; "
                  f"{h['device_mallocs_and_frees']:.0f} cudaMalloc/cudaFree calls, syncs flagged at {h['syncs']}")

    step = lambda: (fwd_bwd(), clip_and_step(optimizers[impls[0]]))  # noqa: E731
    _, prof = profiled(step, cuda)
    kernels = kernel_times(prof, cuda)
    total = sum(k[1] for k in kernels)
    print(f"\n{'CUDA' if cuda else 'CPU'} time by {'kernel' if cuda else 'operator'}, one step ({total:.1f} ms in all):")
    for name, t, n in kernels[:args.top]:
        print(f"  {t:8.2f} ms {100 * t / total:5.1f}% x{n:<5} {name[:110]}")
    gaps = {}
    if cuda:  # where the GPU idles in a step, and whether it waited for the host (its launches traced too)
        # a profile of its own: with the host ops in it, key_averages would count each kernel again under its op
        _, traced = profiled(step, cuda, cpu_too=True)
        with tempfile.TemporaryDirectory() as tmp:
            traced.export_chrome_trace(f"{tmp}/step.json")
            gaps = gpu_gaps(json.loads(Path(tmp, "step.json").read_text())["traceEvents"])
        print(f"\nGPU idle, one step: {gaps['idle_ms']:.1f} of {gaps['span_ms']:.1f} ms, "
              f"{gaps['idle_host_bound_ms']:.1f} ms waiting for the host to launch; the most idle time before:")
        for g in gaps["idle_before"][:10]:
            print(f"  {g['ms']:7.2f} ms  {g['why']:>10}  {g['op'][:100]}")
    path = result_path("train_step", args.json)
    write_json(path, {"model": args.model, "layers": args.layers, "backend": args.backend,
                      "routing": cfg.moe.routing.method, "batch": [B, S],
                      "compile": args.compile, "param_dtype": args.param_dtype if cuda else "fp32",
                      "phases_ms": ms, "steps": summary, "host": host, "gpu_gaps": gaps,
                      "kernels": [{"name": k, "ms": t, "count": n} for k, t, n in kernels[:100]]})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
