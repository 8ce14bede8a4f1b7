"""bench.trainer_profile: the real trainer's loop with a step range under the profiler (on the CPU: CPU operators,
no GPU gaps), every step's wall time, and a clear error when the run ends before the profile does."""
import json

import pytest

from bench import trainer_profile
from sonic.train import trainer

TINY = ["model=tiny", "data=embedded", "model.num_layers=2", "train.seq_len=64", "train.micro_batch_size=2",
        "train.log_every=2"]


def test_profiles_the_trainers_steps(tmp_path):
    out = tmp_path / "p.json"
    trainer_profile.main(["--at", "2", "--profile-steps", "2", "--json", str(out), *TINY])
    r = json.loads(out.read_text())
    assert r["steps"] == 10 and r["profiled_steps"] == [2, 3]
    assert len(r["step_wall_ms"]) == r["steps"] - 1 and all(ms > 0 for ms in r["step_wall_ms"])
    assert any(name == "aten::mm" for name, _, _ in r["top_ms_per_step"])
    assert [step for step, _ in r["tokens_per_s_per_gpu"]] == [2, 4, 6, 8, 10]
    assert not isinstance(trainer.set_lr, trainer_profile.StepProfiler)  # the trainer's own again


def test_a_run_shorter_than_the_profile_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="train.steps=3 ends before the profile does"):
        trainer_profile.main(["--at", "2", "--json", str(tmp_path / "p.json"), *TINY, "train.steps=3"])
