"""Meta-device initialisation (sonic/parallel/init.py) on 2 CPU processes (gloo) and on one:
the sharded init, gathered back, is bit-identical to initialising the whole model in one
process, for every parameter and buffer; each rank stores only its shards; FSDP computes with
those values; full weights (train.init_from) load into the shards; and scripts/first_step.py
reports each rank's memory after init."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.parallel import (
    DistInfo,
    ParallelConfig,
    build_model,
    init_distributed,
    load_full_state_dict,
)
from tests.helpers import free_port, spawn_ranks

WORLD, SEED = 2, 5
REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
# Odd vocabulary: FSDP pads the embedding's dim-0 shards. E=3 shards the experts on dim 1.
# Dense first layer, shared expert, expert biases, qk norms and an untied head: every kind of
# parameter init_weights treats differently.
CASES = {
    "fsdp": (ModelConfig(vocab_size=67, dim=32, num_layers=3, num_heads=2, max_seq_len=32, qk_norm="head",
                         first_k_dense=1, dense_dim=48,
                         moe=MoEConfig(num_experts=3, top_k=2, expert_dim=16, shared_expert_dim=8, expert_bias=True,
                                       kernel_backend="reference")),
             ParallelConfig(activation_checkpoint="selective")),
    "hsdp": (ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=2, max_seq_len=32, qk_norm="full",
                         tie_embeddings=True, moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16,
                                                            kernel_backend="reference")),
             ParallelConfig(dp_replicate=2)),
}


def clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def gathered(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (rotary tables included), unsharded."""
    return {clean(n): full(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}


def reference(cfg: ModelConfig, seed: int = SEED) -> Transformer:
    """Today's init: the whole model in one process."""
    model = Transformer(cfg)
    model.init_weights(seed)
    return model


def ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def build_nan(cfg: ModelConfig, pcfg: ParallelConfig, info: DistInfo):
    """build_model with to_empty's storage filled with NaN (and ints with their max), so anything
    that init leaves untouched cannot pass for a zero."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return build_model(cfg, pcfg, info, seed=SEED)
    finally:
        torch.use_deterministic_algorithms(False)


def _worker(rank: int, port: int, out_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    info = init_distributed(ParallelConfig(), "cpu")
    hsdp = DistInfo(rank, WORLD, rank, CPU, init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_replicate", "dp_shard")))
    results = {}
    for case, (cfg, pcfg) in CASES.items():
        model = build_nan(cfg, pcfg, hsdp if case == "hsdp" else info)
        local = {clean(n): (tuple(p.shape), tuple(p.to_local().shape), p.placements)
                 for n, p in model.named_parameters()}
        weights = gathered(model)
        with torch.no_grad():
            logits = model(ids()).logits_BSV  # FSDP's all-gather reads the shards init wrote
        model = build_model(cfg, pcfg, hsdp if case == "hsdp" else info, seed=SEED)  # sharded, as before step 1
        load_full_state_dict(model, reference(cfg, seed=SEED + 1).state_dict())
        results[case] = {"weights": weights, "local": local, "logits": logits, "loaded": gathered(model)}
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    info.shutdown()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("meta_init") / "results.pt"
    spawn_ranks(_worker, (free_port(), str(out)), WORLD, 300, "meta-init")
    return torch.load(out, weights_only=False)


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]):
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("case", CASES)
def test_sharded_init_is_bit_identical_to_the_whole_model_init(spawned, case):
    ref = reference(CASES[case][0])
    want = gathered(ref)
    assert {"rotary.cos_SHd", "layers.1.ffn.router.expert_bias_E", "layers.1.ffn.router.balance_pending_E"} <= set(want)
    assert_bit_identical(spawned[case]["weights"], want)
    with torch.no_grad():
        torch.testing.assert_close(spawned[case]["logits"], ref(ids()).logits_BSV, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_each_rank_stores_only_its_shards(spawned, case):
    local = spawned[case]["local"]
    for name, (shape, local_shape, placements) in local.items():
        shard = [p for p in placements if isinstance(p, Shard)]
        assert len(shard) == 1, (name, placements)
        want = list(shape)
        if case == "fsdp":  # HSDP's shard groups are single ranks here: each holds everything
            want[shard[0].dim] = math.ceil(shape[shard[0].dim] / WORLD)  # rank 0's part
        assert local_shape == tuple(want), name
    if case == "fsdp":  # the layouts this case is meant to cover
        assert local["embed_tokens.weight"][1] == (34, 32)  # 67 rows: rank 0 holds 34, rank 1 33 (padded)
        assert local["layers.1.ffn.w1_EFD"][2] == (Shard(1),)  # 3 experts do not split over 2 ranks


@pytest.mark.parametrize("case", CASES)
def test_full_weights_load_into_the_shards(spawned, case):
    assert_bit_identical(spawned[case]["loaded"], gathered(reference(CASES[case][0], seed=SEED + 1)))


def test_one_process_builds_the_whole_model_the_same_way():
    cfg, pcfg = CASES["fsdp"]
    model = build_nan(cfg, pcfg, DistInfo(0, 1, 0, CPU, None))
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert_bit_identical(gathered(model), gathered(reference(cfg)))


def test_first_step_script_reports_each_rank(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           "-m", "scripts.first_step", "--json", str(tmp_path / "first_step.json"), "model.num_layers=1",
           "train.micro_batch_size=2", "train.seq_len=16", f"train.run_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "first_step.json").read_text())
    assert out["world_size"] == WORLD and [r["rank"] for r in out["per_rank"]] == list(range(WORLD))
    for r in out["per_rank"]:  # half the fp32 model, plus the unsharded buffers
        assert 0.45 < r["mem_after_init_gib"] / out["full_model_fp32_gib"] < 0.6, out
    assert out["first_step"]["step"] == 1 and math.isfinite(out["first_step"]["loss"])
