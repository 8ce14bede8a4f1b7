"""Expert parallelism against FSDP alone: the training step at each parallel.ep, in one torchrun job.

    torchrun --nproc-per-node 2 -m bench.expert_parallel --eps 1,2 model=sonic_7b model.num_layers=8

Every rank runs the trainer's step (the model as build_model makes it: meta init, EP, compile,
FSDP-2; bf16 autocast on GPU; loss + router loss; clip_grad_norm; AdamW) on batches from the
configured data (Hydra overrides as for train.py; real text by default), one ep after another on
the same batches. Per ep: median step time after warm-up, tokens/s per GPU, peak memory, the
worst layer's expert load (max/mean, so a collapsed router shows), and one profiled step's share
of time in the all-to-all (NCCL SendRecv/AllToAll kernels on GPU; the c10d all-to-all ops on CPU,
where the numbers only smoke-test the script) and, on GPU, the memory one forward holds for backward. Writes bench/results/<date>-<N>x<gpu>-expert_parallel.json.
"""
from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist

from bench.common import compose_config, gpu_name, median_ms, profiled, result_path, write_json
from sonic.data import build_loaders, build_tokenizer
from sonic.models import flops_per_token
from sonic.parallel import build_model, init_distributed
from sonic.train.metrics import peak_flops
from sonic.train.optim import build_optimizer, clip_grad_norm
from sonic.train.trainer import autocast_context

DEFAULTS = ["model=sonic_7b", "model.num_layers=8", "data=local_bpe", "train.micro_batch_size=4",
            "train.seq_len=4096", "optim.lr=1e-4"]
ALL_TO_ALL = ("sendrecv", "alltoall", "all_to_all")


def comm_share(step, cuda: bool) -> dict:
    """One step under torch.profiler: wall time and the time spent in all-to-all kernels (ops on CPU)."""
    wall_ms, prof = profiled(step, cuda)
    spent = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    a2a_ms = sum(spent(e) for e in prof.key_averages() if any(k in e.key.lower() for k in ALL_TO_ALL)) / 1e3
    return {"wall_ms": wall_ms, "all_to_all_ms": a2a_ms, "all_to_all_share": a2a_ms / wall_ms}


def held_for_backward(model, batch, cfg, device) -> float:
    """MiB allocated by the forward and still held when it returns (activations kept for backward,
    and whatever FSDP keeps gathered), less the loss; the backward then frees it."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    with autocast_context(cfg, device):
        out = model(batch["input_ids"].to(device), None, batch["labels"].to(device))
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - before
    (out.loss + out.router_loss).backward()
    model.zero_grad(set_to_none=True)
    return held / 2**20


def run_ep(base_overrides: list[str], ep: int, args) -> dict:
    cfg = compose_config([*DEFAULTS, *base_overrides, f"parallel.ep={ep}"])
    t = cfg.train
    info = init_distributed(cfg.parallel, t.device)
    device, cuda = info.device, info.device.type == "cuda"
    model = build_model(cfg.model, cfg.parallel, info, seed=t.seed)
    optimizer = build_optimizer(model, cfg.optim)
    tokenizer = build_tokenizer(cfg.data)
    loader, _ = build_loaders(cfg.data, tokenizer=tokenizer, seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
                              rank=info.rank, world_size=info.world_size, seed=t.seed)
    batches = [next(loader) for _ in range(args.batches)]  # the same batches at every ep
    loads, turn = [], [0]

    def step():
        batch = batches[turn[0] % len(batches)]
        turn[0] += 1
        with autocast_context(cfg, device):
            out = model(batch["input_ids"].to(device), None, batch["labels"].to(device))
        (out.loss + out.router_loss).backward()
        clip_grad_norm(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loads[:] = [r.counts_E for r in out.routed]

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    step()  # compiles
    first_s = time.perf_counter() - t0
    step_ms = median_ms(step, args.steps, args.warmup, cuda)
    held_mib = held_for_backward(model, batches[0], cfg, device) if cuda else None
    profile = comm_share(step, cuda)
    load_LE = torch.stack(loads).float()
    dist.all_reduce(load_LE)
    tokens = t.micro_batch_size * t.seq_len
    peak = peak_flops(device)
    row = {"ep": ep, "step_ms": step_ms, "tokens_per_s_per_gpu": tokens / step_ms * 1e3,
           "mfu": tokens / step_ms * 1e3 * flops_per_token(cfg.model, t.seq_len) / peak if peak else None,
           "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
           "held_mib": held_mib, "first_step_s": first_s,
           "worst_load_max_over_mean": (load_LE.max(1).values / load_LE.mean(1)).max().item(),
           "expert_load": load_LE.long().tolist(),  # per MoE layer, routed rows per expert over all ranks, last step
           **profile}
    model = optimizer = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eps", default="1,2", help="comma list of parallel.ep values")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batches", type=int, default=4, help="distinct batches cycled through")
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = ap.parse_args(argv)
    rows = [run_ep(args.overrides, int(ep), args) for ep in args.eps.split(",")]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == 0:
        base = rows[0]
        print(f"\n{world} x {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}: "
              f"{' '.join(DEFAULTS + args.overrides)}")
        print(f"{'ep':>3} {'tok/s/GPU':>10} {'vs first':>8} {'peak GiB':>9} {'held MiB':>9} {'all-to-all':>10} "
              f"{'worst load':>10}")
        for r in rows:
            mem = (f"{r['peak_mem_gib']:9.1f} {r['held_mib']:9.0f}" if r["peak_mem_gib"] is not None
                   else f"{'-':>9} {'-':>9}")
            print(f"{r['ep']:>3} {r['tokens_per_s_per_gpu']:>10.0f} {r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:>8.2f} "
                  f"{mem} {100 * r['all_to_all_share']:>9.1f}% {r['worst_load_max_over_mean']:>10.2f}")
        path = result_path("expert_parallel", args.json)
        if not args.json:
            path = path.with_name(path.name.replace(f"-{gpu_name()}-", f"-{world}x{gpu_name()}-"))
        write_json(path, {"world_size": world, "overrides": DEFAULTS + args.overrides, "rows": rows})
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
