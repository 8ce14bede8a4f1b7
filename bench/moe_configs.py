"""The MoE layer shapes the kernel benchmarks run, and the official layer's numbers on them, typed once.

bench/moe_layer.py, bench/moe_block.py and bench/cute_gemm.py run these shapes; scripts/repro compares
with these numbers (scripts/repro/paper.py, the paper's other figures, imports them from here).

- TABLE_9B: the SonicMoE paper's kernel benchmark configs (arXiv 2512.14080, Table 9b), per model size,
  as (T, d, n, E, K).
- REAL_MODELS: two real models' MoE layers, which the official layer was measured on too.
- CONFIGS: every shape by the name the benchmarks' --configs take: a Table 9b config is named by its
  model size, with -E<E> added unless E is 128 (1.4B, 1.4B-E64, 1.4B-E32, ...).
- OFFICIAL_H100: the official sonic-moe 0.1.2.post1 layer on an H100 in this project's set-up (torch 2.11,
  bf16, router included, do_bench median; the OLMoE and 120B rows used the mean), from the project's
  shared notes, not the same process as our runs: fwd, bwd and f+b TFLOPS ((lo, hi) = the range over
  runs) and the activation MiB it held for the backward (GiB figures x 1024).
"""
from __future__ import annotations

Shape = tuple[int, int, int, int, int]

TABLE_9B: dict[str, list[Shape]] = {
    "1.4B": [(40960, 768, 256, 128, 8), (40960, 768, 512, 64, 4), (40960, 768, 1024, 32, 2)],
    "7B": [(24576, 1536, 256, 128, 8), (24576, 1536, 512, 64, 4), (24576, 1536, 1024, 32, 2)],
    "30B": [(32768, 4096, 256, 256, 16), (32768, 4096, 512, 128, 8), (32768, 4096, 1024, 64, 4)],
    "120B": [(32768, 4096, 512, 256, 16), (32768, 4096, 1024, 128, 8), (32768, 4096, 2048, 64, 4)],
}
REAL_MODELS: dict[str, Shape] = {"OLMoE": (32768, 2048, 1024, 64, 8), "Qwen3-Next": (32768, 2048, 512, 512, 10)}

CONFIGS: dict[str, Shape] = {
    **{size if shape[3] == 128 else f"{size}-E{shape[3]}": shape
       for size, shapes in TABLE_9B.items() for shape in shapes},
    **REAL_MODELS,
}
TABLE_9B_NAMES = list(CONFIGS)[:12]

OFFICIAL_H100: dict[Shape, dict] = {CONFIGS[name]: {"name": name, **numbers} for name, numbers in {
    "1.4B": {"fwd": 239, "bwd": 385, "fwdbwd": 320, "held_mib": 336},
    "7B": {"fwd": (225, 249), "bwd": (466, 517), "fwdbwd": 361, "held_mib": 202},
    "30B": {"fwd": 521, "bwd": 460, "fwdbwd": 479, "held_mib": 525},
    "OLMoE": {"fwd": 584, "bwd": 566, "fwdbwd": 572, "held_mib": 1.16 * 1024},
    "Qwen3-Next": {"fwd": 408, "bwd": 336, "fwdbwd": 357, "held_mib": 678},
    "120B": {"fwd": 567, "bwd": 564, "fwdbwd": 565, "held_mib": 1.29 * 1024},
}.items()}


def select_configs(names: str | None, shapes: list[str], default: list[str]) -> dict[str, Shape]:
    """{name: shape} to run: the comma list `names` (None: `default`, or none when shapes are given), then
    each extra "T,d,n,E,K" in `shapes`, named by itself. A ValueError names an unknown config."""
    if names is None:
        names = "" if shapes else ",".join(default)
    chosen = {}
    for name in filter(None, names.split(",")):
        if name not in CONFIGS:
            raise ValueError(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}, or give --shape T,d,n,E,K")
        chosen[name] = CONFIGS[name]
    for spec in shapes:
        try:
            shape = tuple(int(v) for v in spec.split(","))
        except ValueError:
            shape = ()
        if len(shape) != 5 or min(shape) < 1:
            raise ValueError(f"--shape {spec!r}: write five positive integers T,d,n,E,K, e.g. 4096,512,256,16,4")
        chosen[spec] = shape
    return chosen
