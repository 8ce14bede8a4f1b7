"""Entry points write only where they are told. With every output pointed at a temporary folder,
train.py, a resume, `python -m eval` and scripts/export_hf.py leave the checkout's files (tracked,
untracked and ignored) as they were. The repro script that trains (it wrote into the checkout's
runs/ and deleted what was there): tests/scripts/test_repro_writers.py::
test_reduced_run_trains_three_arms_and_renders; scripts/kill_resume.py: tests/parallel/test_kill_resume.py."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import changed_files, checkout_files

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.num_layers=1", "train.micro_batch_size=2", "train.seq_len=32", "train.eval_every=0",
        "train.progress=false", "train.steps=2", "train.save_every=1"]


def python(*args: str) -> None:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_entry_points_leave_the_checkout_untouched(tmp_path):
    before = checkout_files()
    run_dir = tmp_path / "run"
    python("train.py", *TINY, f"train.run_dir={run_dir}")
    python("train.py", *TINY, "train.steps=3", f"train.run_dir={run_dir}")  # a resume
    python("-m", "eval", f"checkpoint={run_dir}", "tasks=[sonic_world]", "limit=2", "bootstrap_iters=0")
    assert (run_dir / "eval" / "results.json").is_file()  # beside the checkpoint, the default
    python("scripts/export_hf.py", str(run_dir), str(tmp_path / "hf"))
    assert changed_files(before, checkout_files()) == []
