"""Host-to-device copies that leave the GPU's queue alone."""
from __future__ import annotations

import torch
from torch import Tensor


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """`host`, a CPU tensor, on `device`. To CUDA through pinned memory without blocking: a copy from pageable memory
    first waits for every kernel already queued, a sync in the step that leaves the GPU idle while the host catches
    up. The pinned buffer is freed only once the copy has run (torch's caching host allocator waits for it)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
