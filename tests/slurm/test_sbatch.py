"""scripts/slurm/train.sbatch on a real local Slurm: one job that trains on 2 CPU ranks, is
preempted twice and finishes. First SIGUSR1 to the batch script (what --signal=B:USR1@N
sends before the time limit): the trainers checkpoint and the script requeues the job. Then
`scontrol requeue` (Slurm's SIGTERM): the trainers checkpoint again and the job comes back.
Each restart resumes from the checkpoint the preemption wrote."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.cluster import wait_for

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
STEPS = 30
OVERRIDES = ["model.num_layers=2", "train.micro_batch_size=2", "train.seq_len=32", f"train.steps={STEPS}",
             "train.log_every=1", "train.save_every=5", "train.eval_every=0", "train.progress=false",
             "optim.schedule=constant"]
TIMEOUT = 180  # per phase; a requeued job waits a few seconds before it starts again


def log_of(out: Path) -> str:
    return out.read_text(errors="replace") if out.exists() else ""


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["step"] for line in lines), default=0)


@pytest.fixture(scope="module")
def job(slurm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sbatch")
    run_dir, out = tmp / "run", tmp / "job.out"
    env = {"NPROC_PER_NODE": "2", "PATH": f"{Path(sys.executable).parent}:{slurm.env['PATH']}"}
    job_id = slurm.sbatch("--cpus-per-task=2", "--time=15", f"--output={out}", "scripts/slurm/train.sbatch",
                          *OVERRIDES, f"train.run_dir={run_dir}", cwd=REPO, env=env)

    def restarted(n: int):
        return lambda: f"(restart {n})" in log_of(out) and "resumed from" in log_of(out).split(f"(restart {n})")[1]

    try:
        wait_for("the first checkpoint", lambda: (run_dir / "checkpoints" / "step_00000005").is_dir(), TIMEOUT)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm.env, check=True)
        wait_for("the job to come back after SIGUSR1", restarted(1), TIMEOUT)
        resumed_at = last_step(run_dir)
        wait_for("a step after the first resume", lambda: last_step(run_dir) > resumed_at, TIMEOUT)
        subprocess.run(["scontrol", "requeue", job_id], env=slurm.env, check=True)
        wait_for("the job to come back after scontrol requeue", restarted(2), TIMEOUT)
        record = slurm.wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), TIMEOUT)
    except TimeoutError as err:
        raise AssertionError(f"{err}\n--- job log ---\n{log_of(out)[-4000:]}") from None
    return {"record": record, "log": log_of(out), "run_dir": run_dir}


def runs_of(log: str) -> list[str]:
    """The log split per start of the job (the script prints '(restart N)' first thing)."""
    return re.split(r"^.*\(restart \d+\).*$", log, flags=re.M)[1:]


def stop_step(text: str) -> int:
    return int(re.search(r"stopped at step (\d+) on a preemption signal", text).group(1))


def resume_step(text: str) -> int:
    return int(re.search(r"resumed from \S+step_(\d{8}) at step", text).group(1))


def test_job_finishes_on_two_ranks_with_checkpoints(job):
    record, log = job["record"], job["log"]
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", record
    assert record["Restarts"] == "2"
    assert "2 worker(s)" in log and "2 rank(s) on cpu" in log
    assert f"step {STEPS} |" in log
    final = job["run_dir"] / "checkpoints" / f"step_{STEPS:08d}"
    meta = json.loads((final / "meta.json").read_text())
    assert (meta["step"], meta["world_size"]) == (STEPS, 2)
    assert {"__0_0.distcp", "__1_0.distcp", "extra_rank0.pt", "extra_rank1.pt"} <= set(meta["files"])
    assert sorted(p.name for p in final.glob("extra_rank*.pt")) == ["extra_rank0.pt", "extra_rank1.pt"]


def test_sigusr1_checkpoints_and_requeues(job):
    first, second, _ = runs_of(job["log"])
    assert "SIGUSR1" in first and "requeued job" in first
    assert resume_step(second) == stop_step(first)


def test_scontrol_requeue_resumes_from_the_checkpoint(job):
    _, second, third = runs_of(job["log"])
    assert "SIGTERM" in second
    assert stop_step(second) > resume_step(second)  # it trained, then saved where it stopped
    assert resume_step(third) == stop_step(second)
