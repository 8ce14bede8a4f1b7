"""Checkpoint faults on 2 gloo ranks where only one rank sees them: a full disk on rank 1 (in
DCP's writer, in our own file), an unwritable run directory on rank 1, a corrupt file that rank 1
verifies. Every rank must raise the same error (no rank left waiting in a collective), and
resume=auto must pick the same checkpoint on both ranks and rename the corrupt one once."""
from __future__ import annotations

import errno
import os
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs

from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.parallel import ParallelConfig, init_distributed, parallelize
from sonic.train.checkpoint import Checkpointer, check_run_dir
from sonic.train.optim import OptimConfig, build_optimizer
from tests.helpers import free_port, spawn_ranks

WORLD = 2


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _attempt(fn) -> str:
    try:
        fn()
    except (Exception, dist.checkpoint.api.CheckpointException) as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "no error"


def _worker(rank: int, port: int, root: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    info = init_distributed(ParallelConfig(), "cpu")
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=2, max_seq_len=32,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16))
    model = Transformer(cfg)
    model.init_weights(seed=0)
    model = parallelize(model, ParallelConfig(), info)
    optimizer = build_optimizer(model, OptimConfig())
    model(torch.randint(0, 64, (2, 8))).logits_BSV.mean().backward()
    optimizer.step()
    ckpt = Checkpointer(pathlib.Path(root) / "checkpoints", keep_last=3)
    save = lambda step: ckpt.save(step, model, optimizer, {}, "model: {}\n")  # noqa: E731
    save(1)
    save(2)
    listing = lambda: sorted(p.name for p in ckpt.root.iterdir())  # noqa: E731
    results = {}

    real_write_item, real_save, real_write_bytes = dcp_fs._write_item, torch.save, pathlib.Path.write_bytes
    if rank == 1:
        dcp_fs._write_item = _enospc
    results["dcp"] = _attempt(lambda: save(3))
    dcp_fs._write_item = real_write_item
    dist.barrier()
    results["dcp listing"] = listing()

    if rank == 1:
        torch.save = lambda obj, f, *a, **k: _enospc() if "extra_rank" in str(f) else real_save(obj, f, *a, **k)
    results["extra"] = _attempt(lambda: save(3))
    torch.save = real_save
    dist.barrier()
    results["extra listing"] = listing()

    if rank == 1:
        pathlib.Path.write_bytes = lambda self, data: _enospc()
    results["run_dir"] = _attempt(lambda: check_run_dir(pathlib.Path(root)))
    pathlib.Path.write_bytes = real_write_bytes

    if rank == 0:  # a file that rank 1 hashes on verification (it wrote it)
        f = ckpt.root / "step_00000002" / "__1_0.distcp"
        f.write_bytes(f.read_bytes()[:100])
    dist.barrier()
    results["found"] = str(ckpt.find("auto"))
    dist.barrier()
    results["found listing"] = listing()
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    info.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_faults")
    out = root / "results.pt"
    spawn_ranks(_worker, (free_port(), str(root), str(out)), WORLD, 180, "checkpoint-fault")
    return root, [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(WORLD)]


INTACT = ["step_00000001", "step_00000002"]


@pytest.mark.parametrize("where", ["dcp", "extra"])
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_and_removes_the_tmp_dir(results, where):
    _, ranks = results
    for r in ranks:
        assert r[where].startswith("OSError: [Errno 28] no space left on device while saving checkpoint "
                                   "step_00000003"), r[where]
        assert "step_00000003.tmp was removed" in r[where] and "train.run_dir" in r[where]
        assert r[f"{where} listing"] == INTACT


def test_an_unwritable_run_dir_on_one_rank_stops_every_rank_and_names_it(results):
    _, ranks = results
    for r in ranks:
        assert r["run_dir"].startswith("ValueError: train.run_dir=") and "rank 1: OSError" in r["run_dir"]
        assert "rank 0" not in r["run_dir"]


def test_every_rank_resumes_from_the_same_checkpoint_and_the_corrupt_one_is_renamed_once(results):
    root, ranks = results
    assert {r["found"] for r in ranks} == {str(root / "checkpoints" / "step_00000001")}
    assert ranks[0]["found listing"] == ranks[1]["found listing"] == ["step_00000001", "step_00000002.corrupt"]
