"""FSDP-2 on 2 CPU processes (gloo) against one process: gradients with every CPU kernel
backend, expert sharding without padding, clipping, accumulation and HSDP."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import Shard

from sonic.kernels import BACKENDS, resolve_backend
from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.parallel import (
    DistInfo,
    ParallelConfig,
    init_distributed,
    parallelize,
    set_gradient_sync,
)
from sonic.parallel.parallelize import expert_shard_dim
from sonic.routing import RoutingConfig, switch_aux_loss
from tests.helpers import free_port, spawn_ranks

WORLD, CLIP = 2, 0.05  # CLIP is below the gradient norm, so clipping really scales
CPU = torch.device("cpu")


def cpu_backends() -> list[str]:
    out = []
    for name in BACKENDS:
        try:
            out.append(resolve_backend(name, CPU))
        except ValueError:  # e.g. triton, cute: GPU only
            pass
    return sorted(set(out))


def build(backend: str, num_experts: int, aux_loss_scope: str = "local") -> Transformer:
    """aux_loss_scope local: each rank's loss is the one-process loss of its batch (global is tested apart)."""
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=2, max_seq_len=32,
                      moe=MoEConfig(num_experts=num_experts, top_k=2, expert_dim=16, kernel_backend=backend,
                                    routing=RoutingConfig(aux_loss_scope=aux_loss_scope)))
    model = Transformer(cfg)
    model.init_weights(seed=0)
    return model


def batches() -> torch.Tensor:
    """[rank, micro-batch] -> input ids (2 sequences of 12 tokens)."""
    return torch.randint(0, 64, (WORLD, 2, 2, 12), generator=torch.Generator().manual_seed(7))


def micro_loss(model, ids) -> torch.Tensor:
    out = model(ids)
    return out.logits_BSV.logsumexp(-1).mean() + out.router_loss


def clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def full_grads(model) -> dict[str, torch.Tensor]:
    return {clean(n): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in model.named_parameters()}


def step(model, ids_MBS, sync_every_micro: bool = False):
    """Accumulate over micro-batches (mean), then clip; return (grads, pre-clip norm)."""
    for m, ids in enumerate(ids_MBS):
        set_gradient_sync(model, sync_every_micro or m == len(ids_MBS) - 1)
        (micro_loss(model, ids) / len(ids_MBS)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return full_grads(model), norm.item()


def _worker(rank: int, port: int, out_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    info = init_distributed(ParallelConfig(), "cpu")
    ids = batches()[rank]
    results = {}
    # E=3 does not divide over 2 ranks: expert weights must shard on another dim, unpadded.
    for backend in cpu_backends():
        model = parallelize(build(backend, 3), ParallelConfig(activation_checkpoint="selective"), info)
        placements = {clean(n): p.placements for n, p in model.named_parameters()}
        results[backend] = (*step(model, ids[:1]), placements)
    # The root keeps the tied embedding gathered from forward to backward (see parallelize).
    model(ids[0])
    results["root gathered after forward"] = not hasattr(model.embed_tokens.weight, "placements")

    calls = {"n": 0}
    real = _fsdp_param_group.foreach_reduce

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    _fsdp_param_group.foreach_reduce = counting
    for sync_every_micro in (False, True):
        calls["n"] = 0
        model = parallelize(build("reference", 4), ParallelConfig(), info)
        grads, norm = step(model, ids, sync_every_micro)
        results[f"accumulate sync_every_micro={sync_every_micro}"] = (grads, norm, calls["n"])
    _fsdp_param_group.foreach_reduce = real

    # Global aux loss: f counts both ranks' picks, P stays this rank's.
    model = parallelize(build("reference", 4, "global"), ParallelConfig(), info)
    out = model(ids[0])
    results[f"aux rank{rank}"] = [(r.aux_loss, r.topk_counts_E) for r in out.routed]
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, results[f"aux rank{rank}"])
    results["aux all"] = gathered

    hsdp = DistInfo(rank, WORLD, rank, CPU, init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_replicate", "dp_shard")))
    model = parallelize(build("reference", 4), ParallelConfig(dp_replicate=2), hsdp)
    results["hsdp"] = (*step(model, ids), model.layers[0].ffn.w1_EFD.placements)
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    info.shutdown()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "results.pt"
    spawn_ranks(_worker, (free_port(), str(out)), WORLD, 300, "FSDP")
    return torch.load(out, weights_only=False)


def reference(backend: str, num_experts: int, micro_batches: int):
    """One process: the mean loss over all ranks' micro-batches, then the same clipping."""
    model = build(backend, num_experts)
    ids = batches()[:, :micro_batches].flatten(0, 1)
    sum(micro_loss(model, x) for x in ids).div(len(ids)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
    return full_grads(model), norm


def assert_grads_close(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=f"grad of {name}")


def test_expert_shard_dim():
    assert expert_shard_dim(torch.Size([128, 512, 1536]), 8) == 0  # E divides: shard experts
    assert expert_shard_dim(torch.Size([8, 512, 1536]), 16) == 1  # E < ranks: shard the expert width
    assert expert_shard_dim(torch.Size([3, 5, 7]), 2) is None  # nothing divides: FSDP's padded dim 0


@pytest.mark.parametrize("backend", cpu_backends())
def test_fsdp_matches_single_process(spawned, backend):
    grads, norm, placements = spawned[backend]
    assert placements["layers.0.ffn.w1_EFD"] == (Shard(1),) and placements["layers.0.ffn.w2_EDN"] == (Shard(1),)
    want_grads, want_norm = reference(backend, 3, 1)
    assert norm == pytest.approx(want_norm, rel=1e-5) and norm > CLIP
    assert_grads_close(grads, want_grads)


def test_root_stays_gathered_for_backward(spawned):
    assert spawned["root gathered after forward"]


def test_accumulation_reduces_once_per_step(spawned):
    want_grads, want_norm = reference("reference", 4, 2)
    groups = 2 + 1  # one FSDP group per block, plus the root
    for sync_every_micro, reductions in ((False, groups), (True, 2 * groups)):
        grads, norm, calls = spawned[f"accumulate sync_every_micro={sync_every_micro}"]
        assert calls == reductions
        assert norm == pytest.approx(want_norm, rel=1e-5)
        assert_grads_close(grads, want_grads)


def test_hsdp_matches_single_process(spawned):
    grads, norm, placement = spawned["hsdp"]
    assert len(placement) == 2  # (replicate, shard) mesh
    want_grads, want_norm = reference("reference", 4, 2)
    assert norm == pytest.approx(want_norm, rel=1e-5)
    assert_grads_close(grads, want_grads)


def test_global_aux_loss_counts_every_ranks_picks(spawned):
    """rank 0's aux = E * sum_e f_e P_e, f from both ranks' top-K picks, P from rank 0's own tokens."""
    model = build("reference", 4)
    inputs = []
    for block in model.layers:
        block.ffn.router.register_forward_pre_hook(lambda mod, args: inputs.append((mod, args[0])))
    model(batches()[0][0])
    ranks = spawned["aux all"]
    for layer, (router, x_TD) in enumerate(inputs):
        picks_E = ranks[0][layer][1] + ranks[1][layer][1]
        assert not torch.equal(picks_E, 2 * ranks[0][layer][1])  # the ranks' loads differ, so the test can fail
        probs_TE = torch.softmax(router.weight_ED.detach() @ x_TD.detach().T, 0).T
        torch.testing.assert_close(ranks[0][layer][0], switch_aux_loss(probs_TE.mean(0), picks_E), rtol=1e-5, atol=1e-6)
