"""The trainer's batch copies: the model's inputs on the device, and on CUDA no wait for the kernels queued."""
import numpy as np
import pytest
import torch

from sonic.data.packing import make_batch
from sonic.train.config import Config
from sonic.train.trainer import model_inputs


def _batch(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    windows = [(rng.integers(0, 1000, 17).astype(np.int64), np.array([5, 11])) for _ in range(3)]
    return make_batch(windows, 16)


@pytest.mark.parametrize("documents", [False, True])
def test_inputs_are_the_batch_with_doc_ids_only_under_document_masking(documents):
    cfg = Config()
    cfg.train.document_masking = documents
    batch = _batch()
    input_ids, doc_ids, labels = model_inputs(batch, cfg, torch.device("cpu"))
    assert torch.equal(input_ids, batch["input_ids"]) and torch.equal(labels, batch["labels"])
    assert (doc_ids is not None) == documents
    if documents:
        assert torch.equal(doc_ids, batch["doc_ids"])


@pytest.mark.gpu
@pytest.mark.parametrize("documents", [False, True])
def test_cuda_copies_do_not_wait_for_the_queued_kernels(documents):
    cfg = Config()
    cfg.train.document_masking = documents
    device = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(20):  # work still queued when the batch is copied
        busy = busy @ busy / 64
    batch = _batch(1)
    torch.cuda.set_sync_debug_mode("error")  # a pageable copy synchronises the stream, and raises here
    try:
        moved = model_inputs(batch, cfg, device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, key in zip(moved, ("input_ids", "doc_ids", "labels")):
        if got is None:
            assert not documents and key == "doc_ids"
            continue
        assert got.device.type == "cuda" and torch.equal(got.cpu(), batch[key])
