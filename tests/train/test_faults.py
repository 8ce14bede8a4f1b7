"""The trainer under faults, in process on a tiny model: a NaN gradient at one step (skip and
stop), a diverging run (optim.lr=1e6) and its recovery, retention around a run of skipped steps,
a corrupt newest checkpoint under resume=auto, and an unwritable run directory."""
import json
import math
import re

import pytest
import torch

from sonic.models import Transformer
from sonic.models.loading import complete_checkpoints, load_model
from sonic.train.checkpoint import Checkpointer
from sonic.train.optim import build_optimizer
from sonic.train import trainer
from sonic.train.trainer import train
from tests.helpers import compose_config

TINY = ["model.num_layers=2", "train.micro_batch_size=4", "train.seq_len=32", "train.log_every=1",
        "train.eval_every=0", "train.progress=false"]


def run(tmp_path, *overrides):
    return train(compose_config(*TINY, f"train.run_dir={tmp_path}", *overrides))


def nan_gradients_at(monkeypatch, *steps: int) -> None:
    """The trainer's calls of clip_grad_norm at `steps` (1-based) first set one gradient element to NaN."""
    real, calls = trainer.clip_grad_norm, []

    def clip(params, *args, **kwargs):
        params = list(params)
        calls.append(1)
        if len(calls) in steps:
            params[0].grad.view(-1)[0] = float("nan")
        return real(params, *args, **kwargs)

    monkeypatch.setattr(trainer, "clip_grad_norm", clip)


@pytest.fixture
def nan_at_step_3(monkeypatch):
    nan_gradients_at(monkeypatch, 3)


def load(path):
    cfg = compose_config(*TINY)
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    extra = Checkpointer(path.parent, keep_last=2).load(path, model, optimizer)
    return model.state_dict(), optimizer.state_dict()["state"], extra


def test_a_nan_step_is_skipped_counted_and_its_checkpoint_deferred_to_the_next_good_step(tmp_path, nan_at_step_3,
                                                                                         caplog):
    history = run(tmp_path, "train.steps=5", "train.save_every=1", "train.keep_last=10")
    assert [h["skipped_steps"] for h in history] == [0, 0, 1, 1, 1]
    assert torch.isnan(torch.tensor(history[2]["grad_norm"])) and history[3]["grad_norm"] > 0
    lrs = [h["lr"] for h in history]
    assert all(a < b for a, b in zip(lrs, lrs[1:]))  # the warmup went on through the skipped step
    assert "step 3 was skipped: its checkpoint waits" in caplog.text
    ckpts = {int(p.name[5:]): load(p) for p in complete_checkpoints(tmp_path / "checkpoints")}
    assert sorted(ckpts) == [1, 2, 4, 5]  # none of the skipped step
    for step, (model, optim, _) in ckpts.items():
        assert all(torch.isfinite(t).all() for t in model.values()), step
        assert all(torch.isfinite(v).all() for s in optim.values() for v in s.values()), step
    (m2, o2, _), (m4, o4, extra4) = ckpts[2], ckpts[4]
    assert not all(torch.equal(m2[k], m4[k]) for k in m2)  # step 4 trained again ...
    assert all(o4[i]["step"] == o2[i]["step"] + 1 for i in o2)  # ... once: step 3 left AdamW's step count alone
    assert extra4["guard"]["skipped"] == 1 and extra4["guard"]["streak_start"] == 3


def test_stop_raises_at_the_nan_step_before_any_update_or_save(tmp_path, nan_at_step_3):
    with pytest.raises(FloatingPointError, match=r"at step 3 \(train.nonfinite=stop\).*after step 2"):
        run(tmp_path, "train.steps=5", "train.save_every=1", "train.nonfinite=stop")
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step_00000001", "step_00000002"]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def checkpoint_loss(path) -> float:
    """The loss of a checkpoint's weights on a fixed batch, read as eval and export read them."""
    model = load_model(path, kernel_backend="reference").model
    ids = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids[:, :-1], None, ids[:, 1:]).loss.item()


def steps_of(run_dir) -> list[int]:
    return [int(p.name[5:]) for p in complete_checkpoints(run_dir / "checkpoints")]


@pytest.mark.parametrize("healthy_steps", [0, 4])
def test_a_diverged_run_names_a_recovery_that_works(tmp_path, healthy_steps, caplog):
    """The issue: optim.lr=1e6 with train.save_every=5 left checkpoints whose loss is NaN, and the
    fix its error suggested (a lower optim.lr on resume) was ignored. Now the update-size check
    skips every step (none is applied), nothing is saved while steps are skipped, and the error
    names the newest checkpoint and an LR; running the same command with that LR trains on from
    that checkpoint (or from step 0 when there is none)."""
    common = ["train.steps=14", "train.save_every=5", "train.keep_last=2"]
    if healthy_steps:
        run(tmp_path, *common, f"train.steps={healthy_steps}")
    newest = rf"resumes from \S+step_{healthy_steps:08d}, the newest" if healthy_steps else "starts from step 0"
    with pytest.raises(FloatingPointError, match=rf"10 consecutive steps up to step {healthy_steps + 10} .* To "
                                                 rf"recover, run the same command again with a lower LR, e.g. "
                                                 rf"optim.lr=\S+ \(.*{newest}") as info:
        run(tmp_path, *common, "optim.lr=1e6")
    assert steps_of(tmp_path) == ([healthy_steps] if healthy_steps else [])
    assert all(math.isfinite(checkpoint_loss(p)) for p in complete_checkpoints(tmp_path / "checkpoints"))
    lr = re.search(r"optim.lr=(\S+) ", str(info.value)).group(1)
    recovered = run(tmp_path, *common, f"optim.lr={lr}")
    assert [h["step"] for h in recovered] == list(range(healthy_steps + 1, 15))
    assert recovered[-1]["skipped_steps"] == 0 and recovered[-1]["loss"] < recovered[0]["loss"] - 0.3
    assert math.isfinite(checkpoint_loss(tmp_path / "checkpoints" / "step_00000014"))


@pytest.mark.parametrize("healthy_steps", [0, 4])
def test_no_checkpoint_of_a_diverged_run_has_a_non_finite_loss(tmp_path, healthy_steps):
    """Without the update-size check (train.max_update_ratio=0), optim.lr=1e6 overflows the weights
    while the step's own loss and gradient norm stay finite (the issue's run: step 2, grad norm 0).
    The loss of the weights is checked before each save, so the newest remaining checkpoint, and
    every other one, evaluates to a finite loss, and the error names it."""
    if healthy_steps:
        run(tmp_path, f"train.steps={healthy_steps}", "train.save_every=2", "train.keep_last=2")
    with pytest.raises(FloatingPointError, match=r"non-finite loss.*train.resume=auto resumes from \S+step_0000000"):
        run(tmp_path, "train.steps=30", "train.save_every=1", "train.keep_last=2", "optim.lr=1e6",
            "train.max_update_ratio=0")
    losses = {step: checkpoint_loss(tmp_path / "checkpoints" / f"step_{step:08d}") for step in steps_of(tmp_path)}
    assert losses and max(losses) > healthy_steps and all(math.isfinite(v) for v in losses.values()), losses


def test_retention_keeps_the_newest_checkpoint_from_before_a_run_of_skips(tmp_path, monkeypatch):
    nan_gradients_at(monkeypatch, 4, 5)
    history = run(tmp_path, "train.steps=8", "train.save_every=1", "train.keep_last=1")
    assert [h["skipped_steps"] for h in history] == [0, 0, 0, 1, 2, 2, 2, 2]
    assert steps_of(tmp_path) == [3, 8]  # step 3: the last one before steps 4-5 were skipped
    extra = load(tmp_path / "checkpoints" / "step_00000008")[2]
    assert extra["guard"]["streak_start"] == 4 and extra["guard"]["consecutive"] == 0


def test_a_resume_applies_a_new_learning_rate_and_says_so(tmp_path, caplog):
    """The issue: optim.lr on resume was silently replaced by the checkpoint's."""
    common = ["optim.schedule=constant", "optim.warmup_steps=1", "train.save_every=2"]
    first = run(tmp_path, *common, "train.steps=4")
    resumed = run(tmp_path, *common, "train.steps=6", "optim.lr=1e-5")
    assert {h["lr"] for h in first} == {3e-3} and [h["lr"] for h in resumed] == [1e-5, 1e-5]
    assert "2 config change(s)" in caplog.text and "optim.lr: 0.003 -> 1e-05; train.steps: 4 -> 6" in caplog.text


def test_a_resume_that_changes_the_model_shape_is_a_clear_error(tmp_path, caplog):
    run(tmp_path, "train.steps=2", "train.save_every=2")
    with pytest.raises(ValueError, match=r"cannot resume .*step_00000002 with a different model shape "
                                         r"\(model.num_layers: checkpoint 2, now 1\)"):
        run(tmp_path, "train.steps=3", "model.num_layers=1", "model.rope_theta=500000.0")
    with pytest.raises(ValueError, match=r"\(model.dim: checkpoint 128, now 64; model.moe.num_experts: "
                                         r"checkpoint 8, now 4\)"):
        run(tmp_path, "train.steps=3", "model.moe.num_experts=4", "model.dim=64", "model.moe.routing.aux_loss_coef=0.1")
    with pytest.raises(ValueError, match=r"optim.decay_norms_and_embeddings: checkpoint False, now True \(it "
                                         r"regroups"):
        run(tmp_path, "train.steps=3", "optim.decay_norms_and_embeddings=true")
    history = run(tmp_path, "train.steps=3", "model.rope_theta=500000.0", "model.moe.routing.aux_loss_coef=0.1")
    assert [h["step"] for h in history] == [3]
    warnings = [r.getMessage() for r in caplog.records if "config change" in r.getMessage()]
    assert len(warnings) == 1 and "model.rope_theta: 10000.0 -> 500000.0" in warnings[0]
    assert "model.moe.routing.aux_loss_coef: 0.01 -> 0.1" in warnings[0]


def test_metrics_jsonl_holds_each_step_once_after_a_resume(tmp_path):
    """A run killed after logging steps 3 and 4 but before saving step 4 logs them again on resume."""
    run(tmp_path, "train.steps=4", "train.save_every=2")
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / "step_00000004")  # as if killed mid-save
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 1.')  # and mid-write
    run(tmp_path, "train.steps=6", "train.save_every=2")
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_resume_auto_recovers_from_a_truncated_newest_checkpoint(tmp_path, caplog):
    """The issue's measurement: a half-truncated .distcp used to stop every requeued run."""
    first = run(tmp_path, "train.steps=4", "train.save_every=2")
    for f in (tmp_path / "checkpoints" / "step_00000004").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    again = run(tmp_path, "train.steps=4", "train.save_every=2")
    assert "step_00000004 is corrupt" in caplog.text
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000004",
                                                                            "step_00000004.corrupt"]
    assert [h["step"] for h in again] == [3, 4]  # resumed from step 2
    assert [h["loss"] for h in again] == [h["loss"] for h in first[2:]]  # bit-exact


def test_an_unwritable_run_dir_fails_before_training(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"train.run_dir=.* cannot be written"):
        run(tmp_path / "a_file" / "run", "train.steps=1")
