"""The trainer under faults, in process on a tiny model: a NaN gradient at one step (skip and
stop), a diverging run (optim.lr=1e6), a corrupt newest checkpoint under resume=auto, and an
unwritable run directory."""
import json

import pytest
import torch

from sonic.models import Transformer
from sonic.models.loading import complete_checkpoints
from sonic.train.checkpoint import Checkpointer
from sonic.train.optim import build_optimizer
from sonic.train import trainer
from sonic.train.trainer import train
from tests.helpers import compose_config

TINY = ["model.num_layers=2", "train.micro_batch_size=4", "train.seq_len=32", "train.log_every=1",
        "train.eval_every=0", "train.progress=false"]


def run(tmp_path, *overrides):
    return train(compose_config(*TINY, f"train.run_dir={tmp_path}", *overrides))


@pytest.fixture
def nan_at_step_3(monkeypatch):
    """The trainer's third call of clip_grad_norm (step 3) first sets one gradient element to NaN."""
    real, calls = trainer.clip_grad_norm, []

    def clip(params, *args, **kwargs):
        params = list(params)
        calls.append(1)
        if len(calls) == 3:
            params[0].grad.view(-1)[0] = float("nan")
        return real(params, *args, **kwargs)

    monkeypatch.setattr(trainer, "clip_grad_norm", clip)


def load(path):
    cfg = compose_config(*TINY)
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    extra = Checkpointer(path.parent, keep_last=2).load(path, model, optimizer)
    return model.state_dict(), optimizer.state_dict()["state"], extra


def test_a_nan_step_is_skipped_counted_and_kept_out_of_every_checkpoint(tmp_path, nan_at_step_3):
    history = run(tmp_path, "train.steps=5", "train.save_every=1", "train.keep_last=10")
    assert [h["skipped_steps"] for h in history] == [0, 0, 1, 1, 1]
    assert torch.isnan(torch.tensor(history[2]["grad_norm"])) and history[3]["grad_norm"] > 0
    lrs = [h["lr"] for h in history]
    assert all(a < b for a, b in zip(lrs, lrs[1:]))  # the warmup went on through the skipped step
    ckpts = {int(p.name[5:]): load(p) for p in complete_checkpoints(tmp_path / "checkpoints")}
    assert sorted(ckpts) == [1, 2, 3, 4, 5]
    for step, (model, optim, _) in ckpts.items():
        assert all(torch.isfinite(t).all() for t in model.values()), step
        assert all(torch.isfinite(v).all() for s in optim.values() for v in s.values()), step
    (m2, o2, _), (m3, o3, extra3), (m4, _, _) = ckpts[2], ckpts[3], ckpts[4]
    assert all(torch.equal(m2[k], m3[k]) for k in m2)  # step 3 changed no weight ...
    assert all(torch.equal(o2[i][k], o3[i][k]) for i in o2 for k in o2[i])  # ... nor AdamW's state or step
    assert not all(torch.equal(m3[k], m4[k]) for k in m3)  # step 4 trained again
    assert extra3["guard"]["skipped"] == 1 and extra3["scheduler"]["last_epoch"] == 3


def test_stop_raises_at_the_nan_step_before_any_update_or_save(tmp_path, nan_at_step_3):
    with pytest.raises(FloatingPointError, match=r"at step 3 \(train.nonfinite=stop\).*after step 2"):
        run(tmp_path, "train.steps=5", "train.save_every=1", "train.nonfinite=stop")
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step_00000001", "step_00000002"]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_diverging_run_stops_after_max_consecutive_skips_with_only_finite_checkpoints(tmp_path):
    """The issue's measurement: optim.lr=1e6 went NaN and was only noticed at a log step."""
    with pytest.raises(FloatingPointError, match=r"3 consecutive steps up to step \d+ had a non-finite gradient"):
        run(tmp_path, "optim.lr=1e6", "train.steps=30", "train.log_every=5", "train.save_every=1",
            "train.keep_last=30", "train.max_consecutive_skips=3")
    ckpts = complete_checkpoints(tmp_path / "checkpoints")
    assert ckpts
    for path in ckpts:
        model, _, extra = load(path)
        assert all(torch.isfinite(t).all() for t in model.values()), path
        assert extra["guard"]["consecutive"] < 3  # the save before the limit; none after it


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
