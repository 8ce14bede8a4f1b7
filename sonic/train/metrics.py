"""Throughput, MFU, memory and expert-load metrics (names as in DESIGN.md)."""
from __future__ import annotations

import torch
from torch import Tensor

from sonic.models.params import TrainingFlops
from sonic.parallel import all_reduce_

# Dense bf16 tensor-core peak per GPU (FLOP/s), matched against the device name.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("RTX 4090", 165e12),
)


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> float | None:
    """Peak bf16 FLOP/s of one device, or None where unknown (MFU is then not reported)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def speed_metrics(tokens_per_s_per_gpu: float, world_size: int, flops: TrainingFlops, peak: float | None,
                  device: torch.device) -> dict[str, float]:
    """Per GPU: tokens/s, MFU and the peak memory of the fullest GPU; for the whole job:
    tokens/s and billion tokens/day (the paper's unit).

    Two MFUs: `mfu_causal` counts the attention a causal mask needs (half the score matrix), the
    headline figure; `mfu` counts the full S x S attention (PaLM's formula), as every result file
    before it did. docs/performance.md has the formula and a worked example."""
    tokens_per_s = tokens_per_s_per_gpu * world_size
    out = {"tokens_per_s_per_gpu": tokens_per_s_per_gpu, "tokens_per_s": tokens_per_s,
           "btokens_per_day": tokens_per_s * 86400 / 1e9}
    if peak:
        out["mfu_causal"] = tokens_per_s_per_gpu * flops.causal / peak
        out["mfu"] = tokens_per_s_per_gpu * flops.full / peak
    if device.type == "cuda":
        # reserved: what the caching allocator holds; retries: its frees-and-retries on a failed cudaMalloc, each a
        # device sync, the sign of a GPU too full for its batch (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
        stats = torch.cuda.memory_stats(device)
        mem = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device)
                            / 2**30, stats.get("num_alloc_retries", 0)], device=device, dtype=torch.float64)
        peak_gib, reserved_gib, retries = all_reduce_(mem, "max").tolist()
        out.update(mem_peak_gib=peak_gib, mem_reserved_gib=reserved_gib, alloc_retries=int(retries))
    return out


def expert_load(counts_LE: Tensor) -> dict[str, float]:
    """Per-layer load of each expert, as a fraction of the mean: min, max and CV."""
    counts = counts_LE.float()
    mean = counts.mean(-1, keepdim=True).clamp_min(1e-9)
    rel = counts / mean
    out = {}
    for layer, row in enumerate(rel):
        out[f"expert_load_min/{layer}"] = row.min().item()
        out[f"expert_load_max/{layer}"] = row.max().item()
        out[f"expert_load_cv/{layer}"] = (row.std(unbiased=False)).item()
    out["expert_load_max_worst"] = rel.max().item()  # the most loaded expert of the worst layer (E/K = collapsed)
    return out
