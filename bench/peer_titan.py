"""The training-step peer: Sonic's model against torchtitan 0.3.0's Qwen3-MoE, in one harness, like for like.

    python -m bench.peer_titan --which sonic|titan [--compile] [--layers 8] [--backend cute] [--data local_bpe]
                               [--set KEY=VALUE ...] [--kernels N]

Both models at sonic_7b's dims (d 1536, 24 heads of 64, E 128, K 8, n 256, vocab 100352, tied embeddings), Sonic's
shared expert off (torchtitan's Qwen3 has none), wrapped alike: FSDP-2 on a one-rank mesh with bf16 parameters and
fp32 gradient reduction (how both train on GPUs), per-block torch.compile with --compile, torch's fused AdamW, the
clip at 1.0 and the same loss, fp32 cross-entropy over the logits. So every row is like for like
(`like_for_like: true`). Sonic's own step (Triton AdamW with fp32 masters, the chunked loss) is what
`bench.train_step` and the e2e table measure; it is not this harness's.

Tokens: --data names a Sonic data preset whose batches both models train on (default local_bpe, offline text, built
on first use; its tokenizer fits the 100352-token vocabulary); `random` draws uniform ids, under which routing is
uniform: a diagnostic, not what users run.

torchtitan is a benchmark-only dependency, carried to the GPU machine: unpack the wheels of torchtitan==0.3.0,
spmd_types==0.2.3, einops, tyro, docstring-parser and typeguard (pip download --no-deps) into --titan-path (default
.tt, an ignored folder). `titan_qwen3()` stands in for the two names torch 2.11 lacks.

Appends one JSON row per run to --jsonl (default bench/results/<date>-<gpu>-peer_titan.jsonl): which, compile,
layers, batch, data, backend, sets (Sonic's config overrides), attention, gpu, params, step_ms (median over --steps
after --warmup), step_ms_best and step_ms_all, tokens_per_s, peak_gib, loss, like_for_like, commit and command; with
--host N the host's issue time against the wall time (bench.common.host_bound), with --kernels N one profiled
step's N slowest kernels. Run each side in its own process (one model per GPU).
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from bench.common import (RESULTS, compose_config, cuda_or_exit, git_commit, gpu_name, host_bound, kernel_times,
                          profiled)

DIMS = {"dim": 1536, "heads": 24, "head_dim": 64, "experts": 128, "top_k": 8, "expert_dim": 256, "vocab": 100352}


def titan_qwen3(path: str):
    """torchtitan's qwen3 module from `path`, made to import and run on torch 2.11 (the GPU machine's)."""
    sys.path.insert(0, path)
    import torch.distributed.fsdp as fsdp  # noqa: PLC0415

    if not hasattr(fsdp, "DataParallelMeshDims"):  # named in torchtitan's imports only
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {"__init__": lambda self, *a, **k: None})
    try:
        import torchtitan.models.common.attention as attn  # noqa: PLC0415
        import torchtitan.models.qwen3 as qwen3  # noqa: PLC0415
    except ImportError as err:
        raise SystemExit(f"bench.peer_titan --which titan: cannot import torchtitan from {path!r} ({err}); unpack "
                         "torchtitan==0.3.0 and its light dependencies there (see this module's docstring)") from err
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415

    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        def block_mask(*args, separate_full_blocks=True, **kwargs):
            return create_block_mask(*args, **kwargs)
        attn._compiled_create_block_mask = torch.compile(block_mask)
    return qwen3


def titan_model(layers: int, B: int, S: int, device: torch.device, path: str):
    """(model, its blocks, forward(ids) -> logits) of torchtitan's Qwen3-MoE at sonic_7b's dims."""
    q, d = titan_qwen3(path), DIMS
    cfg = q.Qwen3Model.Config(
        vocab_size=d["vocab"], dim=d["dim"], norm=q._qwen3_norm(d["dim"]), enable_weight_tying=True,
        tok_embeddings=q.Embedding.Config(num_embeddings=d["vocab"], embedding_dim=d["dim"],
                                          param_init=q._EMBEDDING_SKIP_INIT),
        lm_head=q.Linear.Config(in_features=d["dim"], out_features=d["vocab"], param_init=q._LINEAR_INIT),
        layers=q._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=layers, dim=d["dim"], n_heads=d["heads"], n_kv_heads=d["heads"],
            head_dim=d["head_dim"], moe_hidden_dim=d["expert_dim"], num_experts=d["experts"], top_k=d["top_k"],
            attn_backend="flex", rope=q.CosSinRoPE.Config(dim=d["head_dim"], max_seq_len=S, theta=10000.0),
            moe_comm_backend="standard"))
    with device:
        model = cfg.build()
    model.init_states(buffer_device=device)
    positions = torch.arange(S, device=device).expand(B, S)
    masks = model.get_attention_masks(positions)
    return model, list(model.layers.values()), lambda ids: model(ids, positions, masks)


def sonic_model(layers: int, backend: str, device: torch.device, sets: list[str] = ()):
    """(model, its blocks, forward(ids) -> logits) of sonic_7b cut to `layers`, shared expert off, with the dotted
    ModelConfig overrides `sets` (key=value, e.g. attention_backend=sdpa)."""
    from omegaconf import OmegaConf  # noqa: PLC0415

    from sonic.models.moe import MoE  # noqa: PLC0415
    from sonic.models.presets import load_preset  # noqa: PLC0415
    from sonic.models.transformer import Transformer  # noqa: PLC0415

    overrides = OmegaConf.merge({"num_layers": layers, "moe": {"shared_expert_dim": 0, "kernel_backend": backend}},
                                OmegaConf.from_dotlist(list(sets)))
    cfg = load_preset("sonic_7b", **OmegaConf.to_container(overrides))
    assert (cfg.dim, cfg.vocab_size, cfg.moe.num_experts, cfg.moe.top_k) == (
        DIMS["dim"], DIMS["vocab"], DIMS["experts"], DIMS["top_k"]), "sonic_7b's dims moved: update DIMS"
    with device:
        model = Transformer(cfg)
    model.init_weights(seed=0)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.resolve_backends(device)  # now, not inside the first compiled forward
    return model, list(model.layers), lambda ids: model(ids).logits_BSV


def attention_kernel(which: str, model, S: int, device: torch.device) -> str:
    """What each side's attention runs: torchtitan's flex; Sonic's the model's own core, or for `auto` the core
    it picks for these plain causal batches (AutoCore.mask returns it beside its mask)."""
    if which == "titan":
        return "flex"
    core = model.attn_core
    return core.mask(None, S, device)[0].name if core.name == "auto" else core.name


def batches(data: str, B: int, S: int, device: torch.device):
    """Endless (inputs, targets) pairs on `device`: Sonic's loader over the data preset `data`, or uniform ids."""
    if data == "random":
        gen = torch.Generator().manual_seed(0)
        while True:
            tokens = torch.randint(0, DIMS["vocab"], (B, S + 1), generator=gen)
            yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    from sonic.data import build_loaders, build_tokenizer  # noqa: PLC0415

    cfg = compose_config(["experiment=sonic_7b", f"data={data}", f"train.seq_len={S}", f"train.micro_batch_size={B}"])
    tokenizer = build_tokenizer(cfg.data)
    if tokenizer.vocab_size > DIMS["vocab"]:
        raise SystemExit(f"--data {data}: its tokenizer has {tokenizer.vocab_size} ids, the models {DIMS['vocab']}")
    loader, _ = build_loaders(cfg.data, tokenizer=tokenizer, seq_len=S, micro_batch_size=B, seed=0)
    for batch in loader:
        labels = batch["labels"].clamp_min(0)  # padding (-100) scored as id 0 on both sides alike
        yield batch["input_ids"].to(device), labels.to(device)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--which", required=True, choices=("sonic", "titan"))
    ap.add_argument("--compile", action="store_true", help="torch.compile each block, on both sides alike")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", default="4x4096", help="micro-batch x sequence length")
    ap.add_argument("--backend", default="cute", help="Sonic's model.moe.kernel_backend")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a dotted override of Sonic's "
                    "model config (sonic side only; repeatable), e.g. attention_backend=sdpa: what one lever buys")
    ap.add_argument("--data", default="local_bpe", help="a Sonic data preset, or random (a diagnostic)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--titan-path", default=".tt", help="where torchtitan 0.3.0 and its light deps are unpacked")
    ap.add_argument("--device", default="cuda", help="cpu only smoke-tests the harness (gloo; timings meaningless)")
    ap.add_argument("--jsonl", default=None)
    ap.add_argument("--host", type=int, default=0, help="then N more steps (GPU only) timed on the host too: the "
                    "median time to issue a step against its wall time (near: the GPU waits for the host), and the "
                    "cudaMalloc/cudaFree calls per step")
    ap.add_argument("--kernels", type=int, default=0, help="then profile one step: its N slowest kernels (CPU: "
                    "operators) go to the row and the screen, to see where one side's step goes")
    args = ap.parse_args(argv)
    B, S = (int(v) for v in args.batch.split("x"))
    if args.set and args.which != "sonic":
        ap.error("--set overrides Sonic's model config: use it with --which sonic")
    if args.host and args.device == "cpu":
        ap.error("--host times the host against the GPU: it needs --device cuda")
    cuda_or_exit(args.device, "bench.peer_titan")
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}/pg",
                                rank=0, world_size=1)
        try:
            row = run(args, B, S, device)
        finally:
            dist.destroy_process_group()
    path = Path(args.jsonl) if args.jsonl else RESULTS / f"{datetime.date.today()}-{gpu_name()}-peer_titan.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


def run(args, B: int, S: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    model, blocks, forward = (titan_model(args.layers, B, S, device, args.titan_path) if args.which == "titan"
                              else sonic_model(args.layers, args.backend, device, args.set))
    params = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        if args.compile:
            block.compile()
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = batches(args.data, B, S, device)

    def step() -> torch.Tensor:
        inputs, targets = next(data)
        loss = F.cross_entropy(forward(inputs).float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    cuda = device.type == "cuda"
    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            loss = step()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            loss = step()
            times.append(1e3 * (time.perf_counter() - t0))
    ms = sorted(times)[len(times) // 2]
    host = host_bound(step, args.host) if args.host else None
    kernels = kernel_times(profiled(step, cuda)[1], cuda)[:args.kernels] if args.kernels else []
    for name, k_ms, calls in kernels:
        print(f"  {k_ms:8.2f} ms {100 * k_ms / ms:5.1f}% x{calls:<4} {name[:110]}")
    return {"which": args.which, "compile": args.compile, "layers": args.layers, "batch": f"{B}x{S}",
            "data": args.data, "backend": args.backend if args.which == "sonic" else "grouped_mm", "sets": args.set,
            "attention": attention_kernel(args.which, model, S, device),
            "gpu": torch.cuda.get_device_name() if cuda else "cpu", "params": params, "step_ms": round(ms, 1),
            "step_ms_best": round(min(times), 1), "step_ms_all": [round(t, 1) for t in times],
            "tokens_per_s": round(B * S / ms * 1e3, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
            "warmup_s": round(warmup_s, 1), "loss": loss.item(), "like_for_like": True, "commit": git_commit(),
            "command": "python -m bench.peer_titan " + " ".join(sys.argv[1:]), "torch": torch.__version__,
            **({"host": host} if host else {}),
            **({"kernels": [{"name": k, "ms": k_ms, "count": n} for k, k_ms, n in kernels]} if kernels else {})}


if __name__ == "__main__":
    main()
