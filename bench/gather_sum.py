"""The cute gather-sum (sonic/kernels/cute/aggregate.py) by column-slice width: the measurement behind
`aggregate.default_max_per_lane`.

Per Table 9b shape class (T, d, E, K; uniform top-K routing from random logits, as a kernel diagnostic) and per
sum (weighted: the forward's O = sum of s * Y rows; unweighted: the backward's dX), the median and best ms of each
cap on the 16-byte chunks a lane holds per column slice (2, 4, 8, 16: 16 keeps a 4096 row whole), interleaved over
--rounds rounds, and which cap the default picks. Every cap's output is checked equal to the whole-row one first
(the sum order within a token does not depend on the slicing), on outputs poisoned with NaN.

    python -m bench.gather_sum [--configs 7B,30B,OLMoE,1.4B] [--rounds 7] [--json out.json]

Writes bench/results/<date>-<gpu>-gather_sum.json (or --json) with the command, date and commit.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import cuda_or_exit, interleaved_ms, result_path, table, write_json
from bench.moe_configs import CONFIGS
from sonic.routing.plan import plan_from_topk

CAPS = (2, 4, 8, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="7B,30B,OLMoE,1.4B")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cuda_or_exit("cuda", "bench.gather_sum")
    from sonic.kernels.cute import aggregate, ops

    records, rows = [], []
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"--configs: unknown config {name!r}; choose from {', '.join(CONFIGS)}")
        T, D, _, E, K = CONFIGS[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        top, idx = torch.randn(T, E, device="cuda", generator=g).topk(K, -1)
        plan = plan_from_topk(idx, torch.softmax(top, -1), E)
        rows_RD = torch.randn(plan.num_rows, D, device="cuda", generator=g).bfloat16()
        out_TD = torch.empty(T, D, device="cuda", dtype=torch.bfloat16)
        for weighted in (True, False):
            w = plan.scores_R if weighted else None

            def run(cap, w=w):
                return ops.gather_sum(rows_RD, plan.token_offsets_T1, plan.rows_by_token_R, w, out=out_TD,
                                      max_per_lane=cap)

            whole = run(16).clone()
            for cap in CAPS:
                out_TD.fill_(float("nan"))
                assert torch.equal(run(cap), whole), f"{name}: cap {cap} differs from the whole-row sum"
            times = interleaved_ms({str(c): (lambda c=c: run(c)) for c in CAPS}, {}, rounds=args.rounds)
            default = aggregate.default_max_per_lane(D, weighted)
            rec = {"config": name, "shape": [T, D, E, K], "weighted": weighted, "default_cap": default,
                   "median_ms": {c: statistics.median(v) for c, v in times.items()},
                   "best_ms": {c: min(v) for c, v in times.items()}}
            rec["fastest_cap"] = int(min(rec["median_ms"], key=rec["median_ms"].get))
            records.append(rec)
            rows.append([name, "w" if weighted else "u"] + [f"{rec['median_ms'][str(c)]:.3f}" for c in CAPS]
                        + [str(default), str(rec["fastest_cap"])])
            print(rows[-1], flush=True)
    print(table(rows, ["config", "sum"] + [f"cap {c} ms" for c in CAPS] + ["default", "fastest"]))
    path = write_json(result_path("gather_sum", args.json),
                      {"what": "cute gather-sum by chunks per lane and column slice", "rounds": args.rounds,
                       "records": records})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
