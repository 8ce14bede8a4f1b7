"""The model's MoE block from two or more source trees, A/B: each tree's compiled block (as bench.moe_block builds it)
in a process of its own, the trees alternating within each of --rounds rounds, on the same inputs. Per tree and
config: the do_bench medians of the forward and the forward+backward, the median milliseconds the host takes to
issue one call (synchronised before and after) compiled and eager, the compiled first call's seconds, and checksums
of the output and the gradients (equal checksums: the change moved no value), and the routed load's busiest expert
over the mean. A diagnostic for a change the interleaved table (bench.moe_block) cannot show, such as host overhead;
the official layer is not run.

--tiles TAG=KIND=CFG,... runs tree TAG with those cute tile configs in place of ops.DEFAULTS' (the tree may be the
same folder as another's): tile configs compared in the block they run in, after the router and the other expert
kernels, as the model runs them (a kernel timed alone, bench/cute_gemm.py between L2 flushes, is a diagnostic; the
up kernel's time moved 3.2-3.8 ms with what ran before it, bench/results/2026-11-29-h200-cute-m256-gathered-ab.json).
The checksums show whether a config moved any value.

    git archive REV sonic configs | tar x -C /tmp/old      (a tree: its sonic/ and configs/)
    python -m bench.block_ab --tree old=/tmp/old --tree new=. [--configs 7B,30B] [--rounds 2] [--backend cute]
    python -m bench.block_ab --tree co=. --tree pp=. --tiles pp=up=pp128 --configs 7B,30B --rounds 3
    python -m bench.block_ab --tree a=. --tree b=. --device cpu --backend reference --shape 64,32,16,4,2 (a smoke run)

Writes bench/results/<date>-<gpu>-block_ab.json (or --json): per round, tree and config the numbers above.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_tiles(text: str) -> dict[str, str]:
    """'up=pp128,dh=co256' -> {kind: config}, each a config that kernel can run (ValueError naming what is not)."""
    from sonic.kernels.cute import ops

    tiles = {}
    for item in filter(None, text.split(",")):
        kind, sep, cfg = item.partition("=")
        if not sep or kind not in ops.DEFAULTS:
            raise ValueError(f"tile config {item!r}: give KIND=CONFIG with KIND one of {', '.join(ops.DEFAULTS)}, "
                             f"e.g. up=pp128")
        ops.check_config(kind, ops.Config.parse(cfg))  # a ValueError that names the config's problem
        tiles[kind] = cfg
    if not tiles:
        raise ValueError(f"tile configs {text!r}: give one or more KIND=CONFIG, e.g. up=pp128,dh=co256")
    return tiles


def use_tiles(tiles: dict[str, str]) -> None:
    """The cute kernels take these configs where ops.default_config would choose (this process only: a child)."""
    from sonic.kernels.cute import ops

    ops.DEFAULTS.update(tiles)
    for kind in tiles:  # at few rows per expert too
        ops.FEW_ROWS_DEFAULTS.pop(kind, None)
    ops.tile_config.cache_clear()


def measure(tag: str, shapes: dict, backend: str, seq_len: int, device: str, tiles: str = "") -> dict:
    """One tree's numbers (run in the child process, whose sonic is the tree's)."""
    import torch

    import sonic
    from bench.common import bench_ms
    from bench.moe_block import block_forward, block_moe_config, load_max_over_mean, sonic_block, step_fns
    from bench.moe_layer import Problem

    if tiles:
        use_tiles(parse_tiles(tiles))

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def issue_ms(fn, clear) -> float:
        """Median milliseconds the host takes to issue fn(), the device idle before and after."""
        times = []
        for _ in range(15):
            clear()
            sync()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        sync()
        return statistics.median(times)

    out = {"tag": tag, "sonic": str(Path(sonic.__file__).parent), "configs": {}}
    for name, shape in shapes.items():
        p = Problem(*shape, device=device)
        moe = sonic_block(p, block_moe_config("sonic_7b", shape, backend))
        moe.resolve_backends(p.device)
        fwd, fb = step_fns(block_forward(moe, p.x, cuda, seq_len), p.dout)
        leaves = [p.x] + list(moe.parameters())

        def clear():
            for t in leaves:
                t.grad = None

        for _ in range(3):  # warm-up: kernels compiled, buffers cached
            clear()
            fb()
        eager_issue = {"fwd": issue_ms(fwd, clear), "fb": issue_ms(fb, clear)}
        if cuda:  # as the trainer runs it (on the CPU, a smoke run, eager: inductor would need a C++ compiler)
            moe.compile()
        t0 = time.perf_counter()
        clear()
        fb()
        sync()
        first_s = time.perf_counter() - t0
        for _ in range(3):
            clear()
            fb()
        clear()
        y = fwd().float()
        fb()
        check = {"out_sum": y.sum().item(), "out_abs": y.abs().sum().item(),
                 "dx_abs": p.x.grad.float().abs().sum().item(),
                 "drouter_abs": moe.router.weight_ED.grad.float().abs().sum().item(),
                 "dw1_abs": moe.w1_EFD.grad.float().abs().sum().item()}
        issue = {"fwd": issue_ms(fwd, clear), "fb": issue_ms(fb, clear)}
        clear()
        out["configs"][name] = {"fwd_ms": statistics.median(bench_ms(fwd, leaves) for _ in range(3)),
                                "fb_ms": statistics.median(bench_ms(fb, leaves) for _ in range(3)),
                                "issue_ms": issue, "eager_issue_ms": eager_issue, "first_call_s": first_s,
                                "check": check, "load_max_over_mean": load_max_over_mean(moe, p.x, cuda, seq_len)}
        del moe, p
        if cuda:
            torch.cuda.empty_cache()
    return out


def run_tree(tag: str, tree: Path, shapes: dict, args) -> dict:
    """measure() in a child process whose `sonic` is tree's (the script runs by its path: `-m` would put the
    working directory, and its sonic, first on the path)."""
    from bench.moe_configs import CONFIGS

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--one", tag, "--configs", ",".join(n for n in shapes if n in CONFIGS),
           "--backend", args.backend, "--seq-len", str(args.seq_len), "--device", args.device,
           *(f"--shape={s}" for s in args.shape), *([f"--tiles={args.tiles_of[tag]}"] if tag in args.tiles_of else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"tree {tag} ({tree}) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if Path(result["sonic"]).resolve() != (tree / "sonic").resolve():
        raise RuntimeError(f"tree {tag} ran {result['sonic']}, not {tree / 'sonic'}")
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="TAG=PATH", help="a source tree (two or more)")
    ap.add_argument("--configs", default=None, help="comma list of bench/moe_configs.py names (default: 7B,30B; "
                                                     "none when --shape is given)")
    ap.add_argument("--shape", action="append", default=[], metavar="T,d,n,E,K", help="an extra config")
    ap.add_argument("--backend", default="cute", help="the block's expert backend")
    ap.add_argument("--device", default="cuda", help="cpu only smoke-tests this script (timings meaningless)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=300, help="per tree and round")
    ap.add_argument("--tiles", action="append", default=[], metavar="TAG=KIND=CFG,...",
                    help="tree TAG's cute tile configs in place of the defaults, e.g. pp=up=pp128,dh=co256")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", metavar="TAG", help=argparse.SUPPRESS)  # the child: measure this process's tree
    args = ap.parse_args(argv)
    from bench.common import cuda_or_exit, result_path, write_json
    from bench.moe_configs import select_configs

    shapes = select_configs(args.configs, args.shape, ["7B", "30B"])
    if args.one:  # the child: its --tiles, if any, is this tree's list alone
        print(json.dumps(measure(args.one, shapes, args.backend, args.seq_len, args.device, ",".join(args.tiles))))
        return
    cuda_or_exit(args.device, "bench.block_ab")
    trees = {}
    for spec in args.tree:
        tag, sep, path = spec.partition("=")
        if not sep or not Path(path, "sonic").is_dir():
            ap.error(f"--tree {spec!r}: give TAG=PATH, a folder with a sonic/ package")
        trees[tag] = Path(path).resolve()
    if len(trees) < 2:
        ap.error("give two or more --tree TAG=PATH")
    args.tiles_of = {}
    for spec in args.tiles:
        tag, _, tiles = spec.partition("=")
        if tag not in trees:
            ap.error(f"--tiles {spec!r}: give TAG=KIND=CONFIG,... for a TAG of --tree ({', '.join(trees)})")
        if args.backend != "cute":
            ap.error(f"--tiles sets the cute kernels' tile configs; the block runs --backend {args.backend}: "
                     f"give --backend cute")
        try:
            parse_tiles(tiles)
        except ValueError as e:
            ap.error(f"--tiles {spec!r}: {e}")
        args.tiles_of[tag] = tiles
    rounds = []
    for r in range(args.rounds):
        rounds.append({tag: run_tree(tag, tree, shapes, args) for tag, tree in trees.items()})
        for tag, res in rounds[-1].items():
            for name, c in res["configs"].items():
                issue, eager = c["issue_ms"], c["eager_issue_ms"]
                print(f"round {r} {tag:>10} {name:>6}  fwd {c['fwd_ms']:.3f} ms  fb {c['fb_ms']:.3f} ms  issue fwd "
                      f"{issue['fwd']:.2f} fb {issue['fb']:.2f} ms (eager {eager['fwd']:.2f} / {eager['fb']:.2f})  "
                      f"out_sum {c['check']['out_sum']:.6g}  load max/mean {c['load_max_over_mean']:.2f}", flush=True)
    path = write_json(result_path("block_ab", args.json),
                      {"trees": {t: str(p) for t, p in trees.items()}, "tiles": args.tiles_of,
                       "configs": {n: list(s) for n, s in shapes.items()}, "backend": args.backend,
                       "seq_len": args.seq_len, "rounds": rounds})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
