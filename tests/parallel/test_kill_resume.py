"""scripts/kill_resume.py on 2 CPU ranks (gloo), the code a 2-GPU run of it executes: SIGKILL of
the whole job, a corrupt newest checkpoint and a SIGUSR1 preemption, each resumed with
train.resume=auto and compared bit for bit with an uninterrupted run."""
from __future__ import annotations

import json

import pytest

from scripts import kill_resume

STEPS, SAVE_EVERY = 10, 2


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("kill_resume")
    out = work / "kill_resume.json"
    got = kill_resume.main(["--out", str(out), "--workdir", str(work), "--steps", str(STEPS),
                            "--save-every", str(SAVE_EVERY)])
    assert json.loads(out.read_text())["scenarios"].keys() == got["scenarios"].keys()
    return got


def test_sigkill_of_the_whole_job_resumes_from_its_newest_checkpoint_bit_exactly(result):
    s = result["scenarios"]["sigkill"]
    assert s["interruption"]["returncode"] == -9 and s["resume"]["returncode"] == 0, s
    assert s["resumed_from"] % SAVE_EVERY == 0 and SAVE_EVERY * 2 <= s["resumed_from"] < STEPS
    assert s["bit_exact"] and s["steps_bit_exact"] == STEPS and s["max_abs_diff"] == 0.0
    assert s["ok"], s["checks"]


def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_older_one_resumed(result):
    s, killed = result["scenarios"]["corrupt"], result["scenarios"]["sigkill"]
    assert s["set_aside"] == [f"{s['corrupted']}.corrupt"]
    assert s["corrupted"] == f"step_{killed['resumed_from']:08d}"  # the newest one
    assert s["resumed_from"] == killed["resumed_from"] - SAVE_EVERY  # keep_last=2: the other one
    assert s["bit_exact"] and s["steps_bit_exact"] == STEPS
    assert s["ok"], s["checks"]


def test_sigusr1_preemption_saves_exits_and_resumes_bit_exactly(result):
    s = result["scenarios"]["sigusr1"]
    assert s["checks"]["trainers saved and stopped on the signal"]
    assert 1 <= s["resumed_from"] < STEPS
    assert s["bit_exact"] and s["steps_bit_exact"] == STEPS
    assert s["ok"], s["checks"]
    assert result["ok"] and result["backend"] == "gloo"


def test_compare_finds_a_one_ulp_difference_and_a_missing_step():
    ref = {1: {"loss": 1.0, "grad_norm": float("nan")}, 2: {"loss": 2.0}}
    assert kill_resume.compare(ref, {1: {"loss": 1.0, "grad_norm": float("nan")}, 2: {"loss": 2.0}}, 2) == (2, 0.0)
    exact, worst = kill_resume.compare(ref, {1: dict(ref[1]), 2: {"loss": 2.0000000000000004}}, 2)
    assert exact == 1 and 0 < worst < 1e-15
    assert kill_resume.compare(ref, {1: dict(ref[1])}, 2)[1] == float("inf")


def test_a_failed_job_keeps_the_end_of_its_output(tmp_path):
    args = kill_resume.parse_args(["--out", str(tmp_path / "r.json"), "--timeout", "120", "--", "model.moe.top_k=99"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "stdout.log").write_text("an earlier job's output\n")
    job = kill_resume.run_job(args, tmp_path / "run")
    assert job["returncode"] != 0 and "top_k" in "\n".join(job["log_tail"]), job
    assert "an earlier job's output" not in job["log_tail"] and len(job["log_tail"]) <= kill_resume.LOG_TAIL
