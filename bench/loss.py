"""The chunked LM-head loss (model.loss_backend=chunked) and its two parts, one GPU:

    python -m bench.loss [--tokens 16384] [--dim 1536] [--vocab 100352]

- one chunk's cross-entropy and d logits: torch.compile's kernel of `_ce_chunk` against the Triton kernel
  (sonic/kernels/triton/cross_entropy.py) that the backend runs on CUDA;
- the head's gradient summed over chunks in fp32: a bf16 GEMM, then an fp32 add (the step before) against
  cuBLAS adding into the fp32 sum in its epilogue (`_accumulate_mm`);
- the whole loss as the model calls it (its forward computes both gradients; the backward scales them).
Defaults are sonic_7b's micro-batch (4 x 4096 tokens), dim and vocabulary. Median of --steps CUDA-event
timings after --warmup. Writes --json (default bench/results/<date>-<gpu>-loss.json). `--device cpu`
smoke-tests the script (eager torch only, tiny shapes: meaningless numbers).
"""
from __future__ import annotations

import argparse

import torch

from bench.common import cuda_or_exit, median_ms, result_path, write_json
from sonic.models import loss as loss_mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=100352)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu only smoke-tests this script (timings meaningless)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = cuda_or_exit(args.device, "bench.loss")
    T, D, V = args.tokens, args.dim, args.vocab
    dt = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=args.device).manual_seed(0)
    h_TD = torch.randn(T, D, device=args.device, generator=g).to(dt).requires_grad_()
    w_VD = (0.02 * torch.randn(V, D, device=args.device, generator=g)).to(dt).requires_grad_()
    labels_T = torch.randint(0, V, (T,), device=args.device, generator=g)
    C = min(T, loss_mod.chunk_tokens(V))  # the backend's chunk
    with torch.no_grad():
        logits_CV = h_TD[:C] @ w_VD.T
        grad_CV = torch.randn(C, V, device=args.device, generator=g).to(dt)
    inv_count = torch.tensor(1.0 / T, device=args.device)
    acc_VD = torch.zeros(V, D, device=args.device)

    parts = {"ce chunk, torch.compile" if cuda else "ce chunk, torch":
             lambda: (loss_mod._compiled_ce_chunk() if cuda else loss_mod._ce_chunk)(logits_CV, labels_T[:C], inv_count),
             "head gradient sum, bf16 GEMM + fp32 add": lambda: acc_VD.add_(grad_CV.T @ h_TD[:C].detach())}
    if cuda:
        from sonic.kernels.triton.cross_entropy import ce_chunk  # noqa: PLC0415

        parts["ce chunk, triton"] = lambda: ce_chunk(logits_CV, labels_T[:C], inv_count, loss_mod.IGNORE_INDEX)
        parts["head gradient sum, GEMM adds in fp32"] = lambda: loss_mod._accumulate_mm(acc_VD, grad_CV.T,
                                                                                      h_TD[:C].detach())

    def whole():
        h_TD.grad = w_VD.grad = None
        loss_mod.chunked_loss(h_TD, w_VD, labels_T).backward()

    parts["chunked loss, forward + backward"] = whole
    ms = {name: median_ms(fn, args.steps, args.warmup, cuda) for name, fn in parts.items()}
    print(f"chunked loss, {T} tokens x {V} vocabulary, dim {D}, chunks of {C} tokens, "
          f"{torch.cuda.get_device_name() if cuda else 'CPU'}")
    for name, v in ms.items():
        print(f"  {name:>40}: {v:8.3f} ms")
    path = result_path("loss", args.json)
    write_json(path, {"tokens": T, "dim": D, "vocab": V, "chunk_tokens": C, "ms": ms})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
