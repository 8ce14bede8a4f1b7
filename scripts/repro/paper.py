"""Published numbers, the only figures in scripts/repro typed in by hand.

Each one is copied from the SonicMoE paper (arXiv 2512.14080, all on H100; the project's PAPER.md
notes quote it) or from the project's shared notes on the official sonic-moe 0.1.2.post1 layer
measured on an H100 in this project's set-up (not the same process as our runs). Table 9b's shapes
and the official layer's numbers are typed once, in bench/moe_configs.py, beside the benchmarks that
run those shapes, and imported here. Everything else a repro script prints comes from a file that a
command in this repository wrote.
"""
from __future__ import annotations

from bench.moe_configs import OFFICIAL_H100, TABLE_9B  # noqa: F401 - the one table, shared with bench/

# PAPER.md "Reported on H100": 7B per-kernel TFLOPS (dx = "up-projection activation gradient")
KERNEL_7B_TF = {"up": 559, "down": 485, "dh": 328, "dx": 618}
LARGE_MODELS_TF_FLOOR = 500  # "30B and 120B exceed 500 TF in forward and in backward"
FWD_VS_CUBLAS = 0.88  # "The forward reaches on average 88% of a cuBLAS batched-GEMM upper bound"
ACT_MEM_7B_N256_VS_SCATTERMOE = -0.45  # "Activation memory on 7B with n=256 is -45% vs ScatterMoE"

# shared notes: a torchtitan-style torch._grouped_mm layer on the 7B shape, H100
GROUPED_MM_7B_H100 = {"fwd": 83, "bwd": 124, "fwdbwd": 106, "held_mib": 2.1 * 1024}

# PAPER.md "Sparse regime": panels (T, d, n, K) with their E sweeps, M_tile 128
SPARSE_PANELS: list[tuple[tuple[int, int, int, int], tuple[int, ...]]] = [
    ((16384, 1536, 256, 8), (64, 128, 256, 512)),
    ((16384, 1536, 1024, 2), (16, 32, 64, 128)),
    ((16384, 4096, 512, 8), (64, 128, 256, 512)),
    ((16384, 4096, 1024, 4), (32, 64, 128, 256)),
]
# PAPER.md "TR speedups": speedup factors (1 + the published percentage); key (K, E)
TR_SPEEDUP = {
    (4, 256): {"setting": "E=256, K=4", "fwd": 1.257, "bwd": 1.118, "fwdbwd": 1.159},
    (10, 512): {"setting": "Qwen3-Next-like K/E 10/512", "fwd": 1.196, "bwd": 1.079, "fwdbwd": None},
}
TR_HEADLINE = 1.16  # "Headline: about 1.16x"

# PAPER.md Table 3: train PPL, val PPL, average accuracy over 11 tasks
TABLE_3A = {
    "0.5B 8/64": {"nr_f": (15.91, 15.94, 50.4), "topk": (16.04, 16.01, 49.8), "drop": (16.52, 16.46, 49.4)},
    "1.8B 8/256": {"nr_f": (13.34, 13.10, 53.5), "topk": (13.51, 13.12, 52.8), "drop": (13.62, 13.19, 52.7)},
    "1.4B 8/128": {"nr_f": (13.51, 13.28, 52.4), "topk": (13.50, 13.32, 52.1), "drop": (13.52, 13.30, 53.5)},
}

# PAPER.md "End to end": 7B MoE (n 256), FSDP-2 in lm-engine, H100
E2E = {
    "sonicmoe": {"btokens_per_day": 213, "gpus": 64, "btokens_per_gpu_day": 3.33},
    "scattermoe": {"btokens_per_day": 225, "gpus": 96},
}
