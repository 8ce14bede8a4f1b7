"""End to end through train.py: 2 gloo processes under torchrun against one process, a
resume on fewer ranks, and each rank's memory after init (every run builds its model by
meta-device init). Kills, preemption and corrupt checkpoints: test_kill_resume.py."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sonic.models import Transformer
from sonic.train.checkpoint import Checkpointer
from sonic.train.optim import build_optimizer
from sonic.train.trainer import train
from tests.helpers import compose_config

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
# Tiny and fast; a constant schedule makes a run's first k steps independent of train.steps.
# A local aux loss: one process with 2 micro-batches then computes what 2 ranks do (the global one
# counts both ranks' picks per micro-batch; tests/parallel/test_fsdp.py checks it).
TINY = ["model.num_layers=2", "train.micro_batch_size=4", "train.seq_len=32", f"train.steps={STEPS}",
        "train.log_every=1", "train.save_every=4", f"train.eval_every={STEPS}", "train.eval_batches=2",
        "train.progress=false", "optim.schedule=constant", "optim.warmup_steps=2",
        "model.moe.routing.aux_loss_scope=local"]
CURVE_KEYS = ("loss", "aux_loss", "z_loss", "grad_norm", "lr")


def torchrun(run_dir: Path, *overrides: str, nproc: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
           "train.py", *TINY, f"train.run_dir={run_dir}", *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    log = (run_dir / "stdout.log").open("ab")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, run_dir: Path, ok: bool = True) -> str:
    rc = proc.wait(timeout=300)
    out = (run_dir / "stdout.log").read_text()
    assert rc == 0 or not ok, f"train.py exited with {rc}:\n{out[-3000:]}"
    return out


def metrics(run_dir: Path) -> dict[int, dict]:
    """Logged metrics by step (a resumed run's lines replace the earlier ones)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {m["step"]: m for m in map(json.loads, lines)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchrun")
    fsdp = torchrun(root / "fsdp")
    # One process meanwhile: 2 micro-batches of 4 per step see the 2 ranks' batches.
    single = train(compose_config(*TINY, "train.grad_accum=2", f"train.run_dir={root / 'single'}"))
    finish(fsdp, root / "fsdp")
    return {"root": root, "single": {h["step"]: h for h in single}, "fsdp": metrics(root / "fsdp")}


def test_two_ranks_follow_the_single_process_loss_curve(runs):
    single, fsdp = runs["single"], runs["fsdp"]
    assert sorted(fsdp) == sorted(single) == list(range(1, STEPS + 1))
    for step in single:
        for key in CURVE_KEYS:
            assert fsdp[step][key] == pytest.approx(single[step][key], rel=2e-5, abs=1e-7), (step, key)
        assert fsdp[step]["expert_load_cv/0"] == pytest.approx(single[step]["expert_load_cv/0"], rel=1e-6)
    assert fsdp[STEPS]["loss"] < fsdp[1]["loss"] - 0.3
    assert "val_loss" in fsdp[STEPS] and fsdp[STEPS]["tokens_per_s_per_gpu"] > 0
    assert fsdp[STEPS]["tokens_per_s"] == pytest.approx(2 * fsdp[STEPS]["tokens_per_s_per_gpu"])


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 1e-3):
    """Equal up to fp32 noise that 8 Adam steps amplify (m/sqrt(v) of near-zero gradients);
    a misplaced shard would be off by the tensor's own scale."""
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * want.double().abs().max().item() + 1e-12, f"{what}: max error {err}"


def _load(path: Path):
    cfg = compose_config(*TINY)
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    other_world = json.loads((path / "meta.json").read_text())["world_size"] != 1
    with pytest.warns(UserWarning, match="rank checkpoint on 1 ranks") if other_world else contextlib.nullcontext():
        Checkpointer(path.parent, keep_last=2).load(path, model, optimizer)
    return model.state_dict(), optimizer.state_dict()["state"]


def test_two_rank_checkpoint_loads_on_one_process(runs):
    step = f"checkpoints/step_{STEPS:08d}"
    model2, optim2 = _load(runs["root"] / "fsdp" / step)
    model1, optim1 = _load(runs["root"] / "single" / step)
    assert model2.keys() == model1.keys()
    for name in model1:
        assert_close_to_scale(model2[name], model1[name], name)
    assert optim2.keys() == optim1.keys()
    for idx in optim1:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_close_to_scale(optim2[idx][key], optim1[idx][key], f"optimizer state {idx} {key}")
    # and train.py continues from it on one process
    history = train(compose_config(*TINY, f"train.steps={STEPS + 2}", f"train.run_dir={runs['root'] / 'one'}",
                                   f"train.resume={runs['root'] / 'fsdp' / step}"))
    assert [h["step"] for h in history] == [STEPS + 1, STEPS + 2]
    assert history[0]["loss"] < runs["fsdp"][1]["loss"] - 0.3  # trained weights, not a fresh start


def test_each_rank_holds_half_the_model_after_meta_init(runs):
    whole = runs["single"][1]["mem_after_init_gib/0"]  # one process: the whole model (the bytes of its tensors on CPU)
    first = runs["fsdp"][1]
    halves = [first[f"mem_after_init_gib/{rank}"] for rank in range(2)]
    assert all(0.45 * whole < h < 0.55 * whole for h in halves), (halves, whole)  # + unsharded buffers
    assert first["mem_after_init_gib"] == max(halves)
    assert "mem_after_init_gib" not in runs["fsdp"][2]  # logged once, with the first step
