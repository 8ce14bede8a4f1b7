"""Figs 14-15 / Table 9b: MoE layer fwd and bwd TFLOPS per kernel backend, beside the paper.

Two modes:
  --run        (GPU) run `python -m bench.moe_layer` on the twelve Table 9b configs, then render
  --from-json  render committed results (default: the newest bench/results/*-moe_layer.json,
               plus any further files given); no GPU needed

Beside our numbers: the official sonic-moe layer where it ran in the same process (same GPU,
same inputs), the official layer on an H100 (bench/moe_configs.py, not same-process), and the
paper's H100 claims (PAPER.md): 30B and 120B > 500 TF fwd and bwd; 7B per-kernel TFLOPS,
which the CuTe per-kernel benchmark (bench/cute_gemm.py, --kernel-json) is set against.
TFLOPS: 6TKnd fwd, 12TKnd bwd, 18TKnd fwd+bwd, router included (bench/moe_layer.py).

  python -m scripts.repro.kernel_throughput --from-json
  python -m scripts.repro.kernel_throughput --run [--backends cute,triton,grouped_mm] [-- extra bench args]
"""
from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from bench.moe_configs import TABLE_9B_NAMES
from scripts.repro import paper
from scripts.repro.common import (DOCS, RESULTS, fmt, load_json, md_table, mid, newest, provenance, pyplot, python,
                                  rel, run, save_figure, shape_str, write_text)

ORDER = ("cute", "triton", "official", "grouped_mm", "reference", "naive")
SIZE_OF = {tuple(s): size for size, shapes in paper.TABLE_9B.items() for s in shapes}


def bench_command(backends: str | None, json_path: Path, extra: list[str]) -> list[str]:
    """bench.moe_layer over the Table 9b configs."""
    cmd = [python(), "-m", "bench.moe_layer", "--configs", ",".join(TABLE_9B_NAMES)]
    if backends:
        cmd += ["--backends", backends]
    return cmd + ["--json", str(json_path)] + extra


def config_rows(payload: dict) -> dict[tuple, dict]:
    """(T, d, n, E, K) -> {backend: record} of one moe_layer result (failed backends dropped)."""
    return {tuple(c["shape"]): {b: r for b, r in c["backends"].items() if "error" not in r}
            for c in payload.get("configs", [])}


def backends_in(rows: dict[tuple, dict]) -> list[str]:
    seen = {b for rec in rows.values() for b in rec}
    return [b for b in ORDER if b in seen] + sorted(seen - set(ORDER))


def triple(rec: dict | None) -> str:
    if not rec:
        return "–"
    return f"{rec['fwd_tf']:.0f} / {rec['bwd_tf']:.0f} / {rec['fwdbwd_tf']:.0f}"


def layer_table(payload: dict, all_configs: bool = True) -> str:
    """One row per config: every backend's fwd / bwd / f+b, then the references. all_configs: also
    list the Table 9b configs this run lacks (as 'not run')."""
    rows = config_rows(payload)
    backends = backends_in(rows)
    shapes = [s for shapes in paper.TABLE_9B.values() for s in shapes] + [s for s in rows if s not in SIZE_OF]
    if not all_configs:
        shapes = [s for s in shapes if s in rows]
    out = []
    for s in shapes:
        rec = rows.get(s)
        off = paper.OFFICIAL_H100.get(s)
        size = SIZE_OF.get(s, (off or {}).get("name", "other"))
        claim = f"> {paper.LARGE_MODELS_TF_FLOOR} / > {paper.LARGE_MODELS_TF_FLOOR}" if size in ("30B", "120B") else "–"
        h100 = f"{fmt(off['fwd'])} / {fmt(off['bwd'])} / {fmt(off['fwdbwd'])}" if off else "–"
        if rec is None:
            out.append([size, shape_str(s)] + ["not run"] * len(backends) + ["–", h100, claim])
            continue
        ratio = (f"{rec['cute']['fwdbwd_tf'] / rec['official']['fwdbwd_tf']:.2f}"
                 if "cute" in rec and "official" in rec else "–")
        out.append([size, shape_str(s)] + [triple(rec.get(b)) for b in backends] + [ratio, h100, claim])
    header = (["size", "(T, d, n, E, K)"] + [f"{b} fwd / bwd / f+b" for b in backends] +
              ["cute ÷ official f+b (same run)", "official, H100 (README)", "paper fwd / bwd (H100)"])
    return md_table(out, header)


def kernel_table(kernel_jsons: list[Path]) -> str:
    """CuTe per-kernel TFLOPS (bench/cute_gemm.py) vs cuBLAS on the same FLOPs and the paper's 7B numbers."""
    out = []
    for path in kernel_jsons:
        payload = load_json(path)
        sh = payload["shape"]
        shape = (sh["T"], sh["D"], sh["N"], sh["E"], sh["K"])
        for r in payload["rows"]:
            if r.get("tflops") is None:
                continue
            paper_tf = paper.KERNEL_7B_TF.get(r["kernel"]) if shape == paper.TABLE_9B["7B"][0] else None
            out.append([payload.get("name", ""), shape_str(shape), r["kernel"], fmt(r["tflops"]),
                        f"{r['vs_cublas']:.2f}" if r.get("vs_cublas") else "–", fmt(paper_tf)])
        lay = payload.get("layer") or {}
        if lay:
            out.append([payload.get("name", ""), shape_str(shape), "layer fwd / bwd / f+b (no router)",
                        f"{lay['fwd_tf']:.0f} / {lay['bwd_tf']:.0f} / {lay['fwd_bwd_tf']:.0f}", "–",
                        f"> {paper.LARGE_MODELS_TF_FLOOR}" if shape in paper.TABLE_9B["30B"] else "–"])
    return md_table(out, ["shape", "(T, d, n, E, K)", "kernel", "TFLOPS (H200)", "÷ cuBLAS same FLOPs",
                          "paper TFLOPS (H100)"])


def default_layer_jsons() -> list[Path]:
    """The newest full layer run (a repro run wins a tie of dates), then the other layer runs of its date."""
    full = sorted(RESULTS.glob("*-moe_layer.json")) + sorted(RESULTS.glob("*-moe_layer-repro.json"))
    if not full:
        newest("*-moe_layer.json")  # exits with the message
    primary = max(full, key=lambda p: (p.name[:10], p.name.endswith("-repro.json")))
    others = [p for p in sorted(RESULTS.glob(f"{primary.name[:10]}-*moe_layer*.json"))
              if p != primary and "sparse" not in p.name and load_json(p).get("configs")]
    return [primary] + others


def render(layer_jsons: list[Path], kernel_jsons: list[Path], out_dir: Path) -> str:
    primary = load_json(layer_jsons[0])
    lines = ["# MoE layer throughput (paper Table 9b configs, Figs 14–15)", "",
             "TFLOPS fwd / bwd / f+b, router included (6TKnd, 12TKnd, 18TKnd). Our backends and the official "
             "sonic-moe column come from one process on one GPU (same inputs); 'official, H100 (README)' is "
             "shared/README.md (other machine, other run); the paper's numbers are H100. Ranges are over runs.", ""]
    for i, path in enumerate(layer_jsons):
        payload = primary if i == 0 else load_json(path)
        lines += [f"## {'Plotted run' if i == 0 else 'Further run'}: `{path.name}`", "", provenance(path, payload), "",
                  layer_table(payload, all_configs=i == 0), ""]
    if kernel_jsons:
        lines += ["## CuTe kernels one by one (bench/cute_gemm.py)", "",
                  "Per-kernel TFLOPS and the ratio to cuBLAS on the same FLOPs. The paper (H100): 7B up 559, down "
                  "485, dH 328, dX (up-projection activation gradient) 618 TF; forward on average "
                  f"{paper.FWD_VS_CUBLAS:.0%} of a cuBLAS batched-GEMM bound. Sources: " +
                  ", ".join(f"`{rel(p)}`" for p in kernel_jsons) + ".", "", kernel_table(kernel_jsons), ""]
    lines += ["![layer throughput](kernel_throughput.png)"]
    text = "\n".join(lines)
    write_text(out_dir / "kernel_throughput.md", text)
    plot(primary, out_dir / "kernel_throughput.png", layer_jsons[0].name)
    return text


def plot(payload: dict, path: Path, name: str) -> None:
    plt = pyplot()
    rows = config_rows(payload)
    backends = [b for b in backends_in(rows) if b not in ("reference", "naive")]  # those two are < 200 TF everywhere
    sizes = list(paper.TABLE_9B)
    fig, axes = plt.subplots(2, len(sizes), figsize=(4.3 * len(sizes), 7), sharey=True)
    width = 0.8 / (len(backends) + 1)
    for col, size in enumerate(sizes):
        shapes = paper.TABLE_9B[size]
        for row, (key, label) in enumerate((("fwd", "forward"), ("bwd", "backward"))):
            ax = axes[row][col]
            for j, b in enumerate(backends):
                ys = [rows.get(s, {}).get(b, {}).get(f"{key}_tf", 0) for s in shapes]
                label = f"{b} (same process)" if b == "official" else b
                ax.bar([i + j * width for i in range(len(shapes))], ys, width, label=label, color=f"C{j}")
            refs = [(i, paper.OFFICIAL_H100[s][key]) for i, s in enumerate(shapes) if s in paper.OFFICIAL_H100]
            for i, v in refs:
                x = i + len(backends) * width
                lo, hi = (v if isinstance(v, (tuple, list)) else (v, v))
                ax.bar(x, mid(v), width, color="none", edgecolor="k", hatch="//", label="official, H100 (README)")
                if hi > lo:
                    ax.errorbar(x, mid(v), yerr=[[mid(v) - lo], [hi - mid(v)]], color="k", capsize=3)
            if size in ("30B", "120B"):
                ax.axhline(paper.LARGE_MODELS_TF_FLOOR, color="r", ls="--", lw=1, label="paper: > 500 TF (H100)")
            for i, s in enumerate(shapes):
                if s not in rows:
                    ax.text(i + 0.35, 20, "not run", ha="center", fontsize=8, rotation=90)
            ax.set_xticks([i + 0.35 for i in range(len(shapes))],
                          [f"n{s[2]} E{s[3]} K{s[4]}" for s in shapes], fontsize=8)
            ax.set_title(f"{size} {label}  (T={shapes[0][0]}, d={shapes[0][1]})", fontsize=9)
            if col == 0:
                ax.set_ylabel("TFLOPS")
            ax.grid(axis="y", alpha=0.3)
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=8,
               bbox_to_anchor=(0.5, -0.03))
    fig.suptitle(f"MoE layer TFLOPS, router included; {payload.get('device', '?')} ({name}); hatched: official "
                 "sonic-moe on an H100 (bench/moe_configs.py)", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    save_figure(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--run", action="store_true", help="run bench.moe_layer on the GPU first")
    mode.add_argument("--from-json", nargs="*", default=None,
                      help="moe_layer result(s) to render; the first is plotted (default: newest *-moe_layer.json)")
    ap.add_argument("--backends", default=None, help="--run: passed to bench.moe_layer")
    ap.add_argument("--json", default=None, help="--run: result path (default bench/results/<date>-<gpu>-moe_layer-repro.json)")
    ap.add_argument("--kernel-json", nargs="*", default=None,
                    help="bench/cute_gemm.py results (default: newest *-cute-7b-final.json and *-cute-30b-final.json)")
    ap.add_argument("--out-dir", default=str(DOCS))
    ap.add_argument("--dry-run", action="store_true", help="--run: print the bench command only")
    ap.add_argument("extra", nargs="*", help="after --: further bench.moe_layer arguments")
    args = ap.parse_args(argv)

    if args.run:
        from bench.common import gpu_name  # noqa: PLC0415

        path = Path(args.json or RESULTS / f"{datetime.date.today().isoformat()}-{gpu_name()}-moe_layer-repro.json")
        run(bench_command(args.backends, path, args.extra), args.dry_run)
        if args.dry_run:
            return
        layer_jsons = [path]
    else:
        layer_jsons = [Path(p) for p in args.from_json] if args.from_json else default_layer_jsons()
    if args.kernel_json is None:
        kernel_jsons = [p for pat in ("*-cute-7b-final.json", "*-cute-30b-final.json") for p in sorted(RESULTS.glob(pat))[-1:]]
    else:
        kernel_jsons = [Path(p) for p in args.kernel_json]
    render(layer_jsons, kernel_jsons, Path(args.out_dir))


if __name__ == "__main__":
    main()
