"""Published numbers, the only figures in scripts/repro typed in by hand.

Each one is copied from /work/shared/PAPER.md (the SonicMoE paper, arXiv 2512.14080, all on
H100) or /work/shared/README.md (the official sonic-moe 0.1.2.post1 layer measured on an H100
in this project's set-up; not the same process as our runs). Everything else a repro script
prints comes from a file that a command in this repository wrote.
"""
from __future__ import annotations

# PAPER.md "Kernel benchmark configs (Table 9b; tuples are T, d, n, E, K)"
TABLE_9B: dict[str, list[tuple[int, int, int, int, int]]] = {
    "1.4B": [(40960, 768, 256, 128, 8), (40960, 768, 512, 64, 4), (40960, 768, 1024, 32, 2)],
    "7B": [(24576, 1536, 256, 128, 8), (24576, 1536, 512, 64, 4), (24576, 1536, 1024, 32, 2)],
    "30B": [(32768, 4096, 256, 256, 16), (32768, 4096, 512, 128, 8), (32768, 4096, 1024, 64, 4)],
    "120B": [(32768, 4096, 512, 256, 16), (32768, 4096, 1024, 128, 8), (32768, 4096, 2048, 64, 4)],
}

# PAPER.md "Reported on H100": 7B per-kernel TFLOPS (dx = "up-projection activation gradient")
KERNEL_7B_TF = {"up": 559, "down": 485, "dh": 328, "dx": 618}
LARGE_MODELS_TF_FLOOR = 500  # "30B and 120B exceed 500 TF in forward and in backward"
FWD_VS_CUBLAS = 0.88  # "The forward reaches on average 88% of a cuBLAS batched-GEMM upper bound"
ACT_MEM_7B_N256_VS_SCATTERMOE = -0.45  # "Activation memory on 7B with n=256 is -45% vs ScatterMoE"

# shared/README.md: official layer on an H100, (T, d, n, E, K) -> fwd, bwd, f+b TF ((lo, hi) = range
# over runs) and held activation MiB (GiB figures x 1024).
OFFICIAL_H100: dict[tuple[int, ...], dict] = {
    (40960, 768, 256, 128, 8): {"name": "1.4B", "fwd": 239, "bwd": 385, "fwdbwd": 320, "held_mib": 336},
    (24576, 1536, 256, 128, 8): {"name": "7B", "fwd": (225, 249), "bwd": (466, 517), "fwdbwd": 361,
                                 "held_mib": 202},
    (32768, 4096, 512, 128, 8): {"name": "30B", "fwd": 521, "bwd": 460, "fwdbwd": 479, "held_mib": 525},
    (32768, 2048, 1024, 64, 8): {"name": "OLMoE", "fwd": 584, "bwd": 566, "fwdbwd": 572, "held_mib": 1.16 * 1024},
    (32768, 2048, 512, 512, 10): {"name": "Qwen3-Next", "fwd": 408, "bwd": 336, "fwdbwd": 357, "held_mib": 678},
    (32768, 4096, 1024, 128, 8): {"name": "120B", "fwd": 567, "bwd": 564, "fwdbwd": 565, "held_mib": 1.29 * 1024},
}
# shared/README.md: torchtitan-style torch._grouped_mm layer on the 7B shape, H100
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
