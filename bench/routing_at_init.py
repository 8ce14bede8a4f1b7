"""Routing of a full-depth model at initialisation: every layer's max/mean expert load and how parallel
the router inputs are, for each attention-output init (model.attn_out_init) and token source; with
--ffn-out-inits and --embed-scales also for those (model.ffn_out_init, model.embed_scale).

    python -m bench.routing_at_init [--model sonic_7b] [--tokens bpe,bytes,random] [--seq 1024]
        [--ffn-out-inits scaled,unscaled] [--embed-scales 1,8]

Each row also has `residual_rms`, the RMS of the residual stream after every block: how large the stream is
that one optimizer step on a block's output projection has to move (docs/routing.md, "Gradient spikes").

"Collapsed" is a layer whose max/mean load is >= 0.9 E/K (nearly every token picks the same K
experts). "cos" is the mean cosine between each router input row and the mean row: near 1, every
token sees the same input. Forward only, no grad, bf16 weights (the full sonic_7b fits in 14 GB of
host memory, so this runs on CPU too; on a GPU it takes seconds). Tokens: `bpe` are the local BPE
data's (data=local_bpe, built and cached on first use), `bytes` the embedded corpus's byte ids,
`random` uniform ids. Writes bench/results/<date>-<device>-routing_at_init.json.
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch

from bench.common import result_path, write_json
from sonic.models import Transformer
from sonic.models.presets import load_preset


def token_ids(source: str, vocab: int, B: int, S: int) -> torch.Tensor:
    if source == "random":
        return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(0))
    if source == "bytes":
        from sonic.data.documents import embedded_path  # noqa: PLC0415

        data = open(embedded_path(), "rb").read()[: B * S]
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long().add(3).view(B, S)
    if source == "bpe":  # the first training batch of data=local_bpe, as the trainer would see it
        from omegaconf import OmegaConf  # noqa: PLC0415

        from sonic.data import DataConfig, build_loaders, build_tokenizer  # noqa: PLC0415

        raw = OmegaConf.create({"model": {"vocab_size": vocab}, "data": OmegaConf.load("configs/data/local_bpe.yaml")})
        data = DataConfig(**OmegaConf.to_container(raw, resolve=True)["data"])
        loader, _ = build_loaders(data, tokenizer=build_tokenizer(data), seq_len=S, micro_batch_size=B, rank=0,
                                  world_size=1, seed=0)
        return next(loader)["input_ids"]
    raise ValueError(f"--tokens {source!r}: use bpe, bytes or random")


@torch.no_grad()
def measure(model: Transformer, ids: torch.Tensor) -> tuple[list[dict], float, list[float]]:
    cos = {}

    def hook(layer):
        def fn(module, args):
            x = args[0].float()
            x = x / x.norm(dim=-1, keepdim=True)
            mean = x.mean(0)
            cos[layer] = (x @ (mean / mean.norm())).mean().item()
        return fn

    handles = [blk.ffn.router.register_forward_pre_hook(hook(i)) for i, blk in enumerate(model.layers) if blk.is_moe]
    rms = {}
    handles += [blk.register_forward_hook(
        lambda m, a, out, i=i: rms.__setitem__(i, out[0].float().square().mean().sqrt().item()))
        for i, blk in enumerate(model.layers)]
    try:
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            out = model(ids[:, :-1], labels_BS=ids[:, 1:])  # the initial LM loss too (ln V is uniform)
    finally:
        for h in handles:
            h.remove()
    rows = []
    for i, r in enumerate(out.routed):
        c = r.counts_E.float()
        rows.append({"layer": i, "max_over_mean": (c.max() / c.mean()).item(),
                     "cv": (c.std(unbiased=False) / c.mean()).item(), "cos_to_mean": cos[i]})
    return rows, out.loss.item(), [rms[i] for i in sorted(rms)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="sonic_7b")
    ap.add_argument("--layers", type=int, default=0, help="cut the model to this many layers (0: the preset's)")
    ap.add_argument("--tokens", default="bpe,bytes,random")
    ap.add_argument("--inits", default="zero,scaled", help="model.attn_out_init values to compare")
    ap.add_argument("--ffn-out-inits", default="scaled", help="model.ffn_out_init values to compare")
    ap.add_argument("--embed-scales", default="1", help="model.embed_scale values to compare")
    ap.add_argument("--batch", default="2x1024", help="sequences x length")
    ap.add_argument("--backend", default="auto", help="model.moe.kernel_backend")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    B, S = (int(v) for v in args.batch.split("x"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    overrides = {"moe": {"kernel_backend": args.backend}, "max_seq_len": S}
    if args.layers:
        overrides["num_layers"] = args.layers
    cfg = load_preset(args.model, **overrides)
    with torch.device(device):
        model = Transformer(cfg).to(torch.bfloat16).eval()
    E, K = cfg.moe.num_experts, cfg.moe.top_k
    results = []
    for init, ffn_out, embed_scale in itertools.product(args.inits.split(","), args.ffn_out_inits.split(","),
                                                          [float(v) for v in args.embed_scales.split(",")]):
        model.cfg.attn_out_init, model.cfg.ffn_out_init, model.cfg.embed_scale = init, ffn_out, embed_scale
        model.init_weights(seed=0)
        for source in args.tokens.split(","):
            t0 = time.perf_counter()
            rows, loss, rms = measure(model, token_ids(source, cfg.vocab_size, B, S + 1).to(device))
            worst = max(r["max_over_mean"] for r in rows)
            collapsed = sum(r["max_over_mean"] >= 0.9 * E / K for r in rows)
            results.append({"attn_out_init": init, "ffn_out_init": ffn_out, "embed_scale": embed_scale,
                            "tokens": source, "worst_max_over_mean": worst, "collapsed_layers": collapsed,
                            "initial_loss": loss, "residual_rms": rms, "layers": rows})
            print(f"attn_out_init={init:6s} ffn_out_init={ffn_out:8s} embed_scale={embed_scale:<5g} "
                  f"tokens={source:6s} worst max/mean {worst:5.2f}  collapsed {collapsed:2d}/{len(rows)}  cos "
                  f"first/mid/last {rows[0]['cos_to_mean']:.2f} {rows[len(rows) // 2]['cos_to_mean']:.2f} "
                  f"{rows[-1]['cos_to_mean']:.2f}  residual RMS after block 0/last {rms[0]:.3f} {rms[-1]:.3f}  "
                  f"loss {loss:.2f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    path = result_path("routing_at_init", args.json)
    write_json(path, {"model": args.model, "num_layers": cfg.num_layers, "batch": [B, S], "E/K": E / K,
                      "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
