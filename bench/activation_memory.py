"""Activation memory an MoE layer holds for backward: SonicMoE reference vs the naive loop.

What is measured: every tensor autograd saves during one forward of `experts(...)`, caught
with `torch.autograd.graph.saved_tensors_hooks`, deduplicated by storage, with the
parameters' storages (w1, w2; views of them included) left out. The plan is built before
the measured forward, so router activations are not counted. Inputs are bf16, uniform
random top-K routing.

The paper's claim (PAPER.md): SonicMoE caches X, H and the routing metadata only,
2Td + 4TKn bytes per layer in bf16, independent of the granularity; ScatterMoE-style
kernels also keep Y (2TKd). The table shows the measured reference, that formula, the
ScatterMoE-like figure (reference + Y, computed), and the measured naive loop, which
keeps the gathered X, H, the fp32 SwiGLU intermediates, A and Y of every expert.

Run:  python -m bench.activation_memory [--T 24576 --d 1536 --n 256 --E 128 --K 8]
      [--measure-T 2048]  measure at this T and at twice it, then extrapolate to --T
                          linearly (every saved byte count is affine in T); default 0:
                          measure at --T itself (the 7B default: about 2 min on 2 CPU cores)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Callable, Iterable

import torch
from torch import Tensor

from sonic.kernels import naive, reference
from sonic.routing.plan import plan_from_topk


def _storage_key(t: Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def saved_tensor_bytes(fn: Callable[[], Tensor], exclude: Iterable[Tensor] = ()) -> tuple[int, Tensor]:
    """Bytes of the distinct storages autograd saves while running fn(), minus `exclude`'s.

    Returns (bytes, fn's output); keep the output alive while the graph is needed.
    """
    skip = {_storage_key(t) for t in exclude}
    seen: dict[tuple[str, int], int] = {}

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key not in skip:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def random_problem(T: int, d: int, n: int, E: int, K: int, dtype: torch.dtype, seed: int = 0):
    """x (leaf), w1, w2 (parameters) and a uniform random top-K plan whose scores need grad."""
    gen = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, d, generator=gen).to(dtype).requires_grad_()
    w1_EFD = (torch.randn(E, 2 * n, d, generator=gen) * d ** -0.5).to(dtype).requires_grad_()
    w2_EDN = (torch.randn(E, d, n, generator=gen) * n ** -0.5).to(dtype).requires_grad_()
    expert_idx_TK = torch.randn(T, E, generator=gen).topk(K, dim=-1).indices
    scores_TK = torch.rand(T, K, generator=gen).softmax(-1)
    plan = plan_from_topk(expert_idx_TK, scores_TK, E)
    plan = plan.with_scores(plan.scores_R.detach().requires_grad_())
    return x_TD, w1_EFD, w2_EDN, plan


def measure(T: int, d: int, n: int, E: int, K: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Saved bytes of the reference and naive paths on one random problem, plus the plan's bytes."""
    x_TD, w1_EFD, w2_EDN, plan = random_problem(T, d, n, E, K, dtype)
    params = (w1_EFD, w2_EDN)
    result = {"plan": plan.nbytes}
    for name, module in (("reference", reference), ("naive", naive)):
        nbytes, out = saved_tensor_bytes(lambda: module.experts(x_TD, w1_EFD, w2_EDN, plan), params)
        result[name] = nbytes
        del out  # frees the graph before the next path runs
    return result


def formula_bytes(T: int, d: int, n: int, K: int, elem: int = 2) -> int:
    """The paper's X + H bytes: 2Td + 4TKn in bf16."""
    return elem * T * d + 2 * elem * T * K * n


def extrapolate(T: int, d: int, n: int, E: int, K: int, measure_T: int) -> dict[str, float]:
    """Measure at measure_T and 2*measure_T and extend the line to T (exact for affine counts)."""
    if measure_T in (0, T):
        return {k: float(v) for k, v in measure(T, d, n, E, K).items()}
    a, b = measure(measure_T, d, n, E, K), measure(2 * measure_T, d, n, E, K)
    return {k: a[k] + (b[k] - a[k]) * (T - measure_T) / measure_T for k in a}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=24576)
    p.add_argument("--d", type=int, default=1536)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--E", type=int, default=128)
    p.add_argument("--K", type=int, default=8)
    p.add_argument("--measure-T", type=int, default=0, dest="measure_T")
    p.add_argument("--json", default=None, help="result path; default bench/results/<date>-cpu-activation_memory.json")
    args = p.parse_args(argv)
    T, d, n, E, K = args.T, args.d, args.n, args.E, args.K

    m = extrapolate(T, d, n, E, K, args.measure_T)
    xh = formula_bytes(T, d, n, K)
    y = 2 * T * K * d
    rows = [
        ("reference (measured)", m["reference"]),
        ("2Td + 4TKn + plan (formula)", xh + m["plan"]),
        ("reference + Y, ScatterMoE-like (computed)", m["reference"] + y),
        ("naive loop (measured)", m["naive"]),
    ]
    how = ("measured at T" if args.measure_T in (0, T) else
           f"measured at T={args.measure_T} and T={2 * args.measure_T}, extrapolated linearly to T={T}")
    result = {"config": {"T": T, "d": d, "n": n, "E": E, "K": K, "dtype": "bfloat16"}, "method": how,
              "bytes": {name: nbytes for name, nbytes in rows}, "plan_bytes": m["plan"],
              "command": "python -m bench.activation_memory " + " ".join(sys.argv[1:] if argv is None else argv)}
    path = args.json or os.path.join("bench", "results",
                                     f"{datetime.date.today().isoformat()}-cpu-activation_memory.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")

    print(f"activation memory held for backward, bf16, (T, d, n, E, K) = ({T}, {d}, {n}, {E}, {K}); {how}")
    print(f"plan metadata: {m['plan'] / 2**20:.2f} MiB")
    for name, nbytes in rows[2:]:
        print(f"reference vs {name}: {100 * (m['reference'] / nbytes - 1):+.1f}%")
    print(f"{'path':<44}{'MiB':>10}{'vs reference':>14}")
    for name, nbytes in rows:
        print(f"{name:<44}{nbytes / 2**20:>10.1f}{nbytes / m['reference']:>13.2f}x")
    return result


if __name__ == "__main__":
    main()
