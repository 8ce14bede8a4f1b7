"""Fig 16: token rounding's kernel speedup over top-K in the sparse regime, beside the paper.

Token rounding (NR-f, M_tile 128) makes every expert's row count a tile multiple, so no GEMM
tile is partly wasted; the gain grows as T*K/E (rows per expert) shrinks. bench.moe_layer's
--sparse-sweep times the experts only (no router), fwd and fwd+bwd, on one top-K plan and its
token-rounded plan for each E.

  python -m scripts.repro.sparse_tr --from-json            # render the newest committed sweep(s)
  python -m scripts.repro.sparse_tr --run [--panels 0,3] [--sweep-backends cute,triton]   # GPU

--run runs one bench.moe_layer per paper panel (PAPER.md "Sparse regime": (T, d, n, K) with its
E sweep) into bench/results/<date>-<gpu>-moe_layer-repro-sparse-<panel>.json, then renders.
The paper gives numbers (not only the figure) for E=256, K=4 and a Qwen3-Next-like K/E 10/512;
those sit beside the matching row.
"""
from __future__ import annotations

import argparse
import datetime
import shlex
from pathlib import Path

from scripts.repro import paper
from scripts.repro.common import (DOCS, RESULTS, load_json, md_table, newest, provenance, pyplot, python, rel, run,
                                  save_figure, shape_str, write_text)

BENCH_DEFAULT = (16384, 1536, 256, 8)  # bench.moe_layer SPARSE (T, d, n, K) when no --sweep-shape is given
TILE = 128


def sweep_shape(payload: dict) -> tuple[int, int, int, int]:
    """(T, d, n, K) of a result's sparse sweep: its own record, else its command's --sweep-shape, else
    bench.moe_layer's default at the time of writing."""
    if payload.get("sweep_shape"):
        return tuple(payload["sweep_shape"])[:4]
    argv = shlex.split(payload.get("command", ""))
    if "--sweep-shape" in argv:
        return tuple(int(v) for v in argv[argv.index("--sweep-shape") + 1].split(","))[:4]
    return BENCH_DEFAULT


def sweep_rows(paths: list[Path]) -> list[dict]:
    """Flattened sweep records with their (T, d, n, K) and source file."""
    rows = []
    for path in paths:
        payload = load_json(path)
        shape = sweep_shape(payload)
        for rec in payload.get("sparse_sweep", []):
            rows.append({**rec, "shape": shape, "source": path, "device": payload.get("device", ""),
                         "date": str(payload.get("date", ""))[:10]})
    if not rows:
        raise SystemExit("no sparse_sweep records in " + ", ".join(rel(p) for p in paths))
    return rows


def paper_ref(shape, E: int) -> dict | None:
    return paper.TR_SPEEDUP.get((shape[3], E))


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * (x - 1):+.1f}%"


def render(paths: list[Path], out_dir: Path) -> str:
    rows = sweep_rows(paths)
    table = []
    for r in sorted(rows, key=lambda r: (r["shape"], r["backend"], r["device"], r["E"], r["date"])):
        T, d, n, K = r["shape"]
        ref = paper_ref(r["shape"], r["E"])
        table.append([shape_str(r["shape"]), r["E"], r["backend"], r["device"], r["date"] or "–",
                      f"{T * K / r['E'] / TILE:g}",
                      f"{r['topk']['rows']} → {r['rounded']['rows']}",
                      f"{r['topk']['fwdbwd_ms']:.3f} → {r['rounded']['fwdbwd_ms']:.3f}",
                      pct(r["speedup_fwd"]), pct(r["speedup_bwd"]), pct(r["speedup_fwdbwd"]),
                      "–" if ref is None else f"{pct(ref['fwd'])} / {pct(ref['bwd'])} / {pct(ref['fwdbwd'])}"])
    have = {(r["shape"][3], r["E"]) for r in rows}
    published = [[v["setting"], pct(v["fwd"]), pct(v["bwd"]), pct(v["fwdbwd"]),
                  "yes" if key in have else "no (not in these sweeps)"] for key, v in paper.TR_SPEEDUP.items()]
    panels = [[shape_str(s), ", ".join(map(str, Es)), "yes" if any(r["shape"] == s for r in rows) else "not run"]
              for s, Es in paper.SPARSE_PANELS]
    lines = ["# Token rounding vs top-K kernel time in the sparse regime (paper Fig 16)", "",
             "Experts only (no router), one top-K plan and its NR-f token-rounded plan (M_tile 128) per E; speedup = "
             "top-K time ÷ rounded time. T̄e/M_tile = T·K/E/128, the mean tiles per expert. The device "
             "and date columns name the GPU and the day of each run; the paper is on H100.", "",
             "\n\n".join(provenance(p, load_json(p)) for p in paths), "",
             md_table(table, ["(T, d, n, K)", "E", "backend", "device", "date", "T̄e/M_tile", "rows top-K → rounded",
                              "f+b ms top-K → rounded", "fwd", "bwd", "f+b", "paper fwd / bwd / f+b (H100)"]), "",
             "## The paper's published speedups (PAPER.md)", "",
             md_table(published, ["setting", "fwd", "bwd", "end to end", "in our sweeps"]), "",
             f"Headline: about {paper.TR_HEADLINE:.2f}×.", "",
             "## The paper's panels", "", md_table(panels, ["(T, d, n, K)", "E sweep", "run here"]), "",
             "![token rounding speedup](sparse_tr.png)"]
    text = "\n".join(lines)
    write_text(out_dir / "sparse_tr.md", text)
    plot(rows, out_dir / "sparse_tr.png")
    return text


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.8), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        sub = [r for r in rows if r["shape"] == shape]
        for j, (backend, device) in enumerate(sorted({(r["backend"], r["device"]) for r in sub})):
            pts = sorted((r for r in sub if (r["backend"], r["device"]) == (backend, device)), key=lambda r: r["E"])
            Es = [r["E"] for r in pts]
            name = f"{backend} ({device.replace('NVIDIA ', '')})"
            ax.plot(Es, [r["speedup_fwdbwd"] for r in pts], "o-", color=f"C{j}", label=f"{name} f+b")
            ax.plot(Es, [r["speedup_fwd"] for r in pts], "^--", color=f"C{j}", alpha=0.6, label=f"{name} fwd")
            ax.plot(Es, [r["speedup_bwd"] for r in pts], "v:", color=f"C{j}", alpha=0.6, label=f"{name} bwd")
        for (K, E), ref in paper.TR_SPEEDUP.items():
            if K == shape[3] and ref["fwdbwd"]:
                ax.plot([E], [ref["fwdbwd"]], "r*", ms=13, label=f"paper f+b, {ref['setting']} (H100)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(paper.TR_HEADLINE, color="r", ls=":", lw=1, label=f"paper headline ~{paper.TR_HEADLINE}x (H100)")
        ax.set_xscale("log", base=2)
        Es = sorted({r["E"] for r in sub})
        ax.set_xticks(Es, [str(e) for e in Es])
        ax.minorticks_off()
        ax.set(title=f"(T, d, n, K) = {shape_str(shape)}", xlabel="E (experts)", ylabel="speedup, top-K ÷ rounded")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Token rounding (NR-f, tile 128) vs top-K, experts only", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--run", action="store_true", help="run the sweeps on the GPU first")
    mode.add_argument("--from-json", nargs="*", default=None,
                      help="results with a sparse_sweep (default: newest sweep files of the newest date)")
    ap.add_argument("--panels", default=",".join(str(i) for i in range(len(paper.SPARSE_PANELS))),
                    help="--run: which paper panels (0-based)")
    ap.add_argument("--sweep-backends", default="triton,grouped_mm", help="--run: passed to bench.moe_layer")
    ap.add_argument("--out-dir", default=str(DOCS))
    ap.add_argument("--dry-run", action="store_true", help="--run: print the bench commands only")
    args = ap.parse_args(argv)

    if args.run:
        from bench.common import gpu_name  # noqa: PLC0415

        paths = []
        for i in (int(v) for v in args.panels.split(",")):
            (T, d, n, K), Es = paper.SPARSE_PANELS[i]
            path = RESULTS / f"{datetime.date.today().isoformat()}-{gpu_name()}-moe_layer-repro-sparse-{i}.json"
            run([python(), "-m", "bench.moe_layer", "--configs", "", "--no-official", "--sparse-sweep",
                 "--sweep-shape", ",".join(map(str, (T, d, n, K, *Es))), "--sweep-backends", args.sweep_backends,
                 "--json", str(path)], args.dry_run)
            paths.append(path)
        if args.dry_run:
            return
    elif args.from_json:
        paths = [Path(p) for p in args.from_json]
    else:
        paths = default_jsons()
    render(paths, Path(args.out_dir))


def default_jsons() -> list[Path]:
    """Every result of the newest date that holds a sparse sweep."""
    candidates = [p for p in sorted(RESULTS.glob("*moe_layer*.json")) if load_json(p).get("sparse_sweep")]
    if not candidates:
        newest("*moe_layer*sparse*.json")  # exits with the message
    date = max(p.name[:10] for p in candidates)
    return [p for p in candidates if p.name.startswith(date)]


if __name__ == "__main__":
    main()
