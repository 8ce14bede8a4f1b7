"""Shared test set-up: GPU tests skip cleanly without CUDA; a CUDA device with Triton, and output poisoning."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def triton_device() -> torch.device:
    """The CUDA device, or a clean skip where the Triton backend cannot run."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sonic.kernels.triton import unavailable_reason

    reason = unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    return torch.device("cuda")


def poisoned_empty(shape, dtype, device):
    """torch.empty that is NaN (floats) or -1 (ints), so any unwritten element shows."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -1, dtype=dtype, device=device)


@pytest.fixture
def poison(monkeypatch):
    """Every buffer the Triton backend's kernels write starts poisoned."""
    from sonic.kernels.triton import centring, function, logit_norm, rounding, routing

    monkeypatch.setattr(function, "_alloc", poisoned_empty)
    monkeypatch.setattr(routing, "_alloc", poisoned_empty)
    monkeypatch.setattr(centring, "_alloc", poisoned_empty)
    monkeypatch.setattr(logit_norm, "_alloc", poisoned_empty)
    monkeypatch.setattr(rounding, "_alloc", poisoned_empty)
