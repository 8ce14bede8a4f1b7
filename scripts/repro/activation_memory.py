"""Fig 13: activation memory per MoE layer as experts get finer (n shrinks, E*n and K*n fixed).

The paper's claim (PAPER.md): SonicMoE caches X, H and the routing plan only, 2Td + 4TKn bytes
in bf16, the same as a dense model of equal active parameters and independent of the
granularity G = d/n; ScatterMoE/MoMoE also keep Y (2TKd), which grows with K at fixed K*n.

What runs here (CPU, no GPU needed):
  sonic        the reference backend, measured: every storage autograd saves in one forward
               (bench.activation_memory.saved_tensor_bytes). The fast kernels (triton, cute)
               save exactly the same tensors (tests check the formula 2Td + 4TKn + plan).
  grouped_mm   the torchtitan-style torch._grouped_mm layer, measured the same way
  naive        the per-expert autograd loop, measured the same way
  +Y           sonic + 2TKd, ScatterMoE-like (computed, not measured)
Each backend is measured at --measure-T and twice that and extended linearly to the config's
T (every saved byte count is affine in T), as bench/activation_memory.py does. The H200
`held` bytes of bench/results/*moe_layer*.json (torch.cuda.memory_allocated around the forward)
are shown beside where a config was run there; they leave out X, which exists before the forward.

  python -m scripts.repro.activation_memory                 # measure (~4 CPU-min) and render
  python -m scripts.repro.activation_memory --from-json bench/results/<date>-cpu-activation_memory-repro.json
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
from pathlib import Path

from scripts.repro import paper
from scripts.repro.common import (DOCS, RESULTS, fmt, load_json, md_table, provenance, pyplot, rel,
                                  save_figure, shape_str, write_text)

BACKENDS = ("reference", "grouped_mm", "naive")
MIB = 2 ** 20


def sweep_configs(finer: int = 1) -> list[dict]:
    """Table 9b's three configs per model size, plus `finer` steps of n/2 (E*2, K*2)."""
    out = []
    for size, shapes in paper.TABLE_9B.items():
        shapes = sorted(shapes, key=lambda s: -s[2])  # coarse -> fine
        T, d, n, E, K = shapes[-1]
        for _ in range(finer):
            n, E, K = n // 2, E * 2, K * 2
            shapes.append((T, d, n, E, K))
        for shape in shapes:
            out.append({"size": size, "shape": list(shape), "in_table_9b": tuple(shape) in paper.TABLE_9B[size]})
    return out


def measure_bytes(T: int, d: int, n: int, E: int, K: int, backends=BACKENDS) -> dict[str, int]:
    """Saved-tensor bytes of one forward per backend (parameters excluded), plus the plan's bytes."""
    import torch

    from bench.activation_memory import random_problem, saved_tensor_bytes
    from sonic.kernels import BACKENDS as REGISTRY

    x, w1, w2, plan = random_problem(T, d, n, E, K, torch.bfloat16)
    result = {"plan": plan.nbytes}
    for name in backends:
        experts = REGISTRY.load(name).experts
        nbytes, out = saved_tensor_bytes(lambda: experts(x, w1, w2, plan), (w1, w2))
        result[name] = nbytes
        del out
        gc.collect()
    return result


def measure_config(shape, measure_T: int) -> dict:
    T, d, n, E, K = shape
    if measure_T <= 0 or measure_T >= T:
        m = measure_bytes(T, d, n, E, K)
        return {"method": "measured at T", **{k: float(v) for k, v in m.items()}}
    a, b = measure_bytes(measure_T, d, n, E, K), measure_bytes(2 * measure_T, d, n, E, K)
    out = {k: a[k] + (b[k] - a[k]) * (T - measure_T) / measure_T for k in a}
    return {"method": f"measured at T={measure_T} and {2 * measure_T}, extended linearly", **out}


def formula_bytes(shape) -> dict[str, int]:
    T, d, n, E, K = shape
    return {"x": 2 * T * d, "h": 4 * T * K * n, "y": 2 * T * K * d}


def gpu_held(moe_jsons: list[Path]) -> dict[tuple, dict]:
    """(T, d, n, E, K) -> {backend: held bytes, '_source': file} from moe_layer results (last file wins)."""
    held: dict[tuple, dict] = {}
    for path in moe_jsons:
        payload = load_json(path)
        for cfg in payload.get("configs", []):
            rec = held.setdefault(tuple(cfg["shape"]), {})
            for backend, r in cfg["backends"].items():
                if "held_bytes" in r:
                    rec[backend] = r["held_bytes"]
            rec["_source"] = rel(path)
            rec["_device"] = payload.get("device", "")
    return held


def measure_all(configs: list[dict], measure_T: int) -> list[dict]:
    rows = []
    for c in configs:
        m = measure_config(c["shape"], measure_T)
        print(f"{c['size']:>5} {shape_str(c['shape'])}: " + "  ".join(
            f"{b} {m[b] / MIB:.0f} MiB" for b in BACKENDS), flush=True)
        rows.append({**c, "bytes": m, "formula": formula_bytes(c["shape"])})
    return rows


def render(payload: dict, gpu: dict[tuple, dict], out_dir: Path, source: Path) -> str:
    rows, gpu_rows = [], []
    for r in payload["rows"]:
        T, d, n, E, K = r["shape"]
        b, f = r["bytes"], r["formula"]
        sonic, formula = b["reference"], f["x"] + f["h"] + b["plan"]
        scatter = sonic + f["y"]
        rows.append([r["size"], shape_str(r["shape"]) + ("" if r["in_table_9b"] else " *"), f"{d / n:g}",
                     fmt(sonic / MIB), fmt(formula / MIB), fmt(scatter / MIB), fmt(b["grouped_mm"] / MIB),
                     fmt(b["naive"] / MIB), f"{100 * (sonic / scatter - 1):+.0f}%"])
        g = gpu.get(tuple(r["shape"]))
        if g:
            gpu_rows.append([r["size"], shape_str(r["shape"])] +
                            [fmt(g[k] / MIB) if k in g else "–" for k in ("cute", "triton", "official", "grouped_mm",
                                                                         "naive")] +
                            [fmt(sonic / MIB), fmt((sonic - f["x"]) / MIB)])
    seven = next((r for r in payload["rows"] if tuple(r["shape"]) == paper.TABLE_9B["7B"][0]), None)
    lines = [
        "# Activation memory vs granularity (paper Fig 13)",
        "",
        "Per-layer bytes held for backward, bf16, as n shrinks with E·n and K·n fixed. Sonic is the reference "
        "backend measured with saved-tensor hooks on CPU; the fast kernels save the same X, H and plan "
        "(2Td + 4TKn + plan). grouped_mm and naive are measured the same way. '+Y' (ScatterMoE-like) is Sonic + "
        "2TKd, computed. " + payload["method"] + ". `*` = one step finer than Table 9b (n/2, 2E, 2K).",
        "",
        provenance(source, payload),
        "",
        md_table(rows, ["size", "(T, d, n, E, K)", "G=d/n", "Sonic MiB", "2Td+4TKn+plan", "+Y (ScatterMoE-like)",
                        "grouped_mm", "naive", "Sonic vs +Y"]),
        "",
    ]
    if seven:
        s = seven["bytes"]["reference"]
        lines += [f"Paper (H100, PAPER.md): activation memory on 7B with n=256 is "
                  f"{100 * paper.ACT_MEM_7B_N256_VS_SCATTERMOE:+.0f}% vs ScatterMoE (measured ScatterMoE); here "
                  f"Sonic vs the computed +Y lower bound: {100 * (s / (s + seven['formula']['y']) - 1):+.0f}%.", ""]
    if gpu_rows:
        srcs = sorted({g["_source"] for g in gpu.values()})
        lines += ["## Beside the GPU measurement", "",
                  "`held` from the layer benchmark (" + ", ".join(f"`{s}`" for s in srcs) + f"; "
                  f"{next(iter(gpu.values()))['_device']}): memory_allocated after the forward minus before, less "
                  "the output. It includes the router's logits and plan and leaves out X (allocated before the "
                  "forward), so compare it with the last column, Sonic minus X.", "",
                  md_table(gpu_rows, ["size", "(T, d, n, E, K)", "cute", "triton", "official", "grouped_mm", "naive",
                                      "Sonic (CPU)", "Sonic − X (CPU)"]), ""]
    official = [[v["name"], shape_str(k), fmt(v["held_mib"])] for k, v in paper.OFFICIAL_H100.items()]
    lines += ["Official sonic-moe on an H100 (shared/README.md, not same-process), held MiB:", "",
              md_table(official, ["config", "(T, d, n, E, K)", "held MiB"]), "",
              "![activation memory](activation_memory.png)"]
    text = "\n".join(lines)
    write_text(out_dir / "activation_memory.md", text)
    plot(payload, gpu, out_dir / "activation_memory.png")
    return text


def plot(payload: dict, gpu: dict[tuple, dict], path: Path) -> None:
    plt = pyplot()
    sizes = list(dict.fromkeys(r["size"] for r in payload["rows"]))
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.6 * len(sizes), 4.0), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        rows = sorted((r for r in payload["rows"] if r["size"] == size), key=lambda r: -r["shape"][2])
        G = [r["shape"][1] / r["shape"][2] for r in rows]
        series = {
            "Sonic (reference, measured)": [r["bytes"]["reference"] for r in rows],
            "+Y, ScatterMoE-like (computed)": [r["bytes"]["reference"] + r["formula"]["y"] for r in rows],
            "grouped_mm (measured)": [r["bytes"]["grouped_mm"] for r in rows],
            "naive (measured)": [r["bytes"]["naive"] for r in rows],
        }
        for (label, ys), style in zip(series.items(), ("o-", "s--", "^-", "v-")):
            ax.plot(G, [y / MIB for y in ys], style, label=label)
        ax.plot(G, [(r["formula"]["x"] + r["formula"]["h"]) / MIB for r in rows], "k:", label="2Td + 4TKn")
        for backend, marker in (("cute", "P"), ("grouped_mm", "X"), ("official", "*")):
            pts = [(g, gpu[tuple(r["shape"])][backend]) for g, r in zip(G, rows)
                   if backend in gpu.get(tuple(r["shape"]), {})]
            if pts:
                ax.plot(*zip(*[(g, b / MIB) for g, b in pts]), marker, ms=9, ls="none", mfc="none",
                        label=f"{backend}, H200 held (excl. X)")
        T, d = rows[0]["shape"][:2]
        ax.set(title=f"{size}: T={T}, d={d}, E·n={rows[0]['shape'][3] * rows[0]['shape'][2]}",
               xlabel="granularity G = d/n", xscale="log", yscale="log")
        if ax is axes[0][0]:
            ax.set_ylabel("MiB per layer")
        ax.set_xticks(G, [f"{g:g}\n(n={r['shape'][2]})" for g, r in zip(G, rows)])
        ax.minorticks_off()
        lo, hi = ax.get_ylim()
        ticks = [v for v in (50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000) if lo <= v <= hi]
        ax.set_yticks(ticks, [str(v) for v in ticks])
        ax.grid(alpha=0.3)
    handles, labels = {}, {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8, bbox_to_anchor=(0.5, -0.1))
    fig.suptitle("Activation memory per MoE layer vs granularity (E·n, K·n fixed); bf16; CPU saved-tensor "
                 "measurement + H200 held", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from-json", default=None, help="render this result instead of measuring")
    ap.add_argument("--measure-T", type=int, default=256, help="measure at this T and twice it (0: at the real T)")
    ap.add_argument("--finer", type=int, default=1, help="extra n/2 steps beyond Table 9b per model size")
    ap.add_argument("--sizes", default=",".join(paper.TABLE_9B), help="model sizes to sweep")
    ap.add_argument("--moe-json", nargs="*", default=None,
                    help="layer-benchmark JSON(s) whose GPU 'held' to show (default: bench/results/*moe_layer*.json)")
    ap.add_argument("--json", default=None, help="where the measurement goes (default bench/results/<date>-cpu-"
                    "activation_memory-repro.json)")
    ap.add_argument("--out-dir", default=str(DOCS))
    args = ap.parse_args(argv)

    if args.from_json:
        source = Path(args.from_json)
        payload = load_json(source)
    else:
        import torch

        sizes = args.sizes.split(",")
        configs = [c for c in sweep_configs(args.finer) if c["size"] in sizes]
        rows = measure_all(configs, args.measure_T)
        payload = {"command": " ".join(["python -m scripts.repro.activation_memory", *(sys.argv[1:] if argv is None else argv)]),
                   "date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "device": "cpu (saved-tensor hooks)", "torch": torch.__version__,
                   "method": rows[0]["bytes"]["method"], "rows": rows}
        source = Path(args.json or RESULTS / f"{datetime.date.today().isoformat()}-cpu-activation_memory-repro.json")
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {rel(source)}")
    moe = [Path(p) for p in args.moe_json] if args.moe_json is not None else sorted(RESULTS.glob("*moe_layer*.json"))
    render(payload, gpu_held([p for p in moe if "repro-sparse" not in p.name]), Path(args.out_dir), source)


if __name__ == "__main__":
    main()
