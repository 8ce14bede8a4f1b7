"""Per-lever training-step throughput: the sonic_7b step with each fast path added in turn, on one GPU.

    python -m bench.levers [--layers 8] [--backend triton] [--batch 4x4096] [--levers all]

Every variant is the trainer's step: FSDP-2 on a one-rank mesh (bf16 parameters, fp32 reduction,
as the trainer shards on several GPUs), bf16 autocast, the model's loss backend, grad clipping and
fused AdamW, timed with CUDA events (median of --steps after --warmup) in one process, one variant
after another. The ladder is cumulative; the alternatives swap one piece of the last rung:

  before           fp32 router GEMM (the previous code, patched in), full fp32 logits, eager
  + bf16 router    the router GEMM in bf16 on the X the experts read
  + chunked loss   LM head + cross-entropy in chunks, no T x V fp32 logits
  + compile        torch.compile per block (parallel.compile)
  liger / cce      Liger-Kernel's or cut-cross-entropy's fused loss instead of ours (if installed)
  doc sdpa / flex  document-masked batches: SDPA with a dense mask vs FlexAttention block masks

Tokens are random ids (a diagnostic of speed; routing on them is balanced by construction); the
40-layer run on real text is `python -m scripts.repro.e2e_throughput --run`. Writes
bench/results/<date>-<gpu>-levers.json; `--device cpu` smoke-tests the script (meaningless numbers).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import time

import torch
import torch.distributed as dist

from bench.common import cuda_or_exit, median_ms, profiled, result_path, write_json
from sonic.models import Transformer, flops_per_token
from sonic.models.presets import load_preset
from sonic.parallel import DistInfo, ParallelConfig, parallelize
from sonic.routing import Router
from sonic.train.metrics import peak_flops
from sonic.train.optim import OptimConfig, build_optimizer


@dataclasses.dataclass
class Lever:
    name: str
    model: dict  # ModelConfig overrides
    compile: bool = False
    fp32_router: bool = False
    documents: bool = False  # packed rows of several documents, masked


LADDER = [
    Lever("before", {"loss_backend": "torch", "attention_backend": "sdpa"}, fp32_router=True),
    Lever("+ bf16 router", {"loss_backend": "torch", "attention_backend": "sdpa"}),
    Lever("+ chunked loss", {"loss_backend": "chunked", "attention_backend": "sdpa"}),
    Lever("+ compile", {"loss_backend": "chunked", "attention_backend": "sdpa"}, compile=True),
    Lever("liger loss", {"loss_backend": "liger", "attention_backend": "sdpa"}, compile=True),
    Lever("cce loss", {"loss_backend": "cce", "attention_backend": "sdpa"}, compile=True),
    Lever("flex causal", {"loss_backend": "chunked", "attention_backend": "flex"}, compile=True),
    Lever("doc sdpa dense mask", {"loss_backend": "chunked", "attention_backend": "sdpa"}, compile=True,
          documents=True),
    Lever("doc flex", {"loss_backend": "chunked", "attention_backend": "flex"}, compile=True, documents=True),
]


@contextlib.contextmanager
def fp32_router_gemm(enabled: bool):
    """The router as it was: X and W upcast to fp32 for the GEMM (so autograd saves an fp32 X)."""
    if not enabled:
        yield
        return
    original = Router.forward

    def forward(self, x_TD, seq_len=None):
        with torch.autocast(x_TD.device.type, enabled=False):
            logits = self.scores(x_TD.float(), self.weight_ED.float(), seq_len)
        return self.route(logits)

    Router.forward = forward
    try:
        yield
    finally:
        Router.forward = original


def one_rank_mesh(device: torch.device) -> DistInfo | None:
    """FSDP-2 on a one-process mesh, as the trainer's sharding looks from one rank."""
    if device.type != "cuda":
        return None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    return DistInfo(0, 1, 0, device, mesh)


def packed_doc_ids(B: int, S: int, gen: torch.Generator, device) -> torch.Tensor:
    """Documents of ~1000 tokens on average, as packed web text."""
    starts = torch.rand(B, S, generator=gen) < 1e-3
    starts[:, 0] = True
    return (starts.long().cumsum(1) - 1).to(device)


def profile_step(step, cuda: bool, top: int = 30) -> dict:
    """One step under torch.profiler: wall time, the time the GPU was busy, and the top kernels.
    Busy well under wall means the host (Python, launches) is what limits."""
    wall_ms, prof = profiled(step, cuda)
    events = [e for e in prof.events() if (e.device_type.name == "CUDA") == cuda and e.time_range.elapsed_us() > 0]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")  # union of kernel intervals: overlapping streams count once
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    spent = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    kernels = sorted(((e.key, spent(e) / 1e3, e.count) for e in prof.key_averages() if spent(e) > 0),
                     key=lambda k: -k[1])
    print(f"profile: wall {wall_ms:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({100 * busy / 1e3 / wall_ms:.0f}%)")
    for name, ms, n in kernels[:top]:
        print(f"  {ms:8.2f} ms x{n:<5} {name[:100]}")
    return {"wall_ms": wall_ms, "busy_ms": busy / 1e3,
            "kernels": [{"name": k, "ms": t, "count": n} for k, t, n in kernels[:100]]}


def run_lever(lever: Lever, args, info: DistInfo | None, device: torch.device) -> dict:
    B, S = args.B, args.S
    cfg = load_preset(args.model, num_layers=args.layers, moe={"kernel_backend": args.backend}, **lever.model)
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    model.init_weights(seed=0)
    cuda = device.type == "cuda"
    model = parallelize(model, ParallelConfig(compile=lever.compile and cuda), info) if info else model
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4, implementation="fused" if cuda else "foreach"))
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=gen).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    docs = packed_doc_ids(B, S, gen, device) if lever.documents else None
    routed = []

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out = model(inputs, docs, labels)
        (out.loss + out.router_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        routed[:] = [r.counts_E for r in out.routed]

    with fp32_router_gemm(lever.fp32_router):
        t0 = time.perf_counter()
        step()  # the first step compiles and autotunes
        if cuda:
            torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        step_ms = median_ms(step, args.steps, max(0, args.warmup - 1), cuda)
        if lever.name == args.profile:
            row_profile = profile_step(step, cuda)
    tps = B * S / step_ms * 1e3
    peak = peak_flops(device)
    loads = [(c.max() / c.float().mean()).item() for c in routed]
    row = {"lever": lever.name, "model": lever.model, "compile": lever.compile, "fp32_router": lever.fp32_router,
           "documents": lever.documents, "step_ms": step_ms, "tokens_per_s": tps,
           "mfu": tps * flops_per_token(cfg, S) / peak if peak else None, "first_step_s": first_s,
           "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
           "max_load_over_mean": max(loads) if loads else None,
           "expert_load": [c.tolist() for c in routed]}  # per MoE layer, routed rows per expert, last step
    if lever.name == args.profile:
        row["profile"] = row_profile
    step = model = optimizer = None  # free the GPU memory before the next lever
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="sonic_7b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--backend", default="triton", help="model.moe.kernel_backend")
    ap.add_argument("--batch", default="4x4096", help="micro-batch x sequence length")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--levers", default="all", help="comma-separated lever names, or all")
    ap.add_argument("--profile", default="", help="profile one step of this lever (busy vs wall, top kernels)")
    ap.add_argument("--device", default="cuda", help="cpu only smoke-tests this script (timings meaningless)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if cuda_or_exit(args.device, "bench.levers"):
        device = torch.device("cuda", torch.cuda.current_device())
    args.B, args.S = (int(v) for v in args.batch.split("x"))
    wanted = None if args.levers == "all" else set(args.levers.split(","))
    levers = [lv for lv in LADDER if wanted is None or lv.name in wanted]
    info = one_rank_mesh(device)
    rows = []
    for lever in levers:
        try:
            rows.append(run_lever(lever, args, info, device))
        except ValueError as err:  # e.g. an optional loss package is not installed
            rows.append({"lever": lever.name, "skipped": str(err)})
        r = rows[-1]
        print(f"{r['lever']:>20}: " + (f"skipped ({r['skipped']})" if "skipped" in r else
              f"{r['step_ms']:8.1f} ms  {r['tokens_per_s'] / 1e3:6.1f}k tok/s  first step {r['first_step_s']:5.1f} s"
              + (f"  MFU {100 * r['mfu']:4.1f}%  peak {r['peak_mem_gib']:5.1f} GiB" if r["mfu"] else "")),
              flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\n{args.model} cut to {args.layers} layers, {args.backend}, {args.B}x{args.S} tokens, {name}")
    base = next((r for r in rows if "tokens_per_s" in r), None)
    for r in rows:
        if "tokens_per_s" in r:
            print(f"  {r['lever']:>20}  {r['tokens_per_s'] / 1e3:6.1f}k tok/s  x{r['tokens_per_s'] / base['tokens_per_s']:.2f}")
    path = result_path("levers", args.json)
    write_json(path, {"model": args.model, "layers": args.layers, "backend": args.backend,
                      "batch": [args.B, args.S], "rows": rows})
    print(f"wrote {path}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
