"""`python train.py -m hydra/launcher=slurm` on the local Slurm: a sweep point runs as a Slurm
job of 2 tasks that join one process group from srun's variables (no torchrun)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]


def test_sweep_point_trains_on_two_tasks(slurm, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the 'slurm' extra "
                        "(pip install -e '.[slurm]')")
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}",
           "hydra.launcher.gpus_per_node=null", "hydra.launcher.tasks_per_node=2", "hydra.launcher.cpus_per_task=1",
           "hydra.launcher.timeout_min=10", "model.num_layers=2", "train.micro_batch_size=2", "train.seq_len=32",
           "train.steps=2", "train.log_every=1", "train.eval_every=0", "train.progress=false",
           "train.run_dir=${hydra:sweep.dir}/${hydra:job.num}", "optim.lr=1e-3"]
    env = {**slurm.env, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    logs = "".join(p.read_text(errors="replace") for p in sorted(sweep.glob(".submitit/*/*_log.*")))
    assert done.returncode == 0, done.stderr[-3000:] + logs[-3000:]
    assert logs.count("2 rank(s) on cpu") == 1, logs[-3000:]  # one job, one process group of 2
    steps = [json.loads(line)["step"] for line in (sweep / "0" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert json.loads((sweep / "0" / "checkpoints" / "step_00000002" / "meta.json").read_text())["world_size"] == 2
