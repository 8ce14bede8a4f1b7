"""train.py end to end in subprocesses: smoke run, kill -9 and exact resume, bad input."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAST = ["model.num_layers=2", "train.micro_batch_size=4", "train.seq_len=64", "train.progress=false",
        "train.eval_batches=2"]


def run_train(*overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *FAST, *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=check)


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (before a kill and after resume) keeps the last."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def test_smoke_run_writes_metrics_and_checkpoint(tmp_path):
    proc = run_train("train.steps=4", "train.log_every=2", "train.eval_every=4", f"train.run_dir={tmp_path}")
    assert "step 4" in proc.stderr + proc.stdout
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [2, 4]
    assert "val_loss" in recs[-1] and recs[-1]["tokens_per_s_per_gpu"] > 0
    assert recs[-1]["routed_rows_ratio"] == 1.0  # top-K routes exactly its T*K rows
    assert (tmp_path / "checkpoints" / "step_00000004" / "meta.json").is_file()


def test_token_drop_logs_the_share_of_rows_it_routes(tmp_path):
    run_train("routing=token_rounding", "model.moe.routing.rounding_mode=down", "model.moe.routing.tile_size=16",
              "train.steps=2", "train.log_every=1", "train.eval_every=0", "train.save_every=0",
              f"train.run_dir={tmp_path}")
    ratios = [json.loads(line)["routed_rows_ratio"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(ratios) == 2 and all(0 < r < 1 for r in ratios), ratios  # rounding down drops the partial tiles


@pytest.mark.slow
def test_kill_and_resume_reproduces_the_uninterrupted_losses(tmp_path):
    common = ["train.steps=10", "train.log_every=1", "train.save_every=3", "train.eval_every=0"]
    run_train(*common, f"train.run_dir={tmp_path / 'straight'}")
    expected = losses(tmp_path / "straight")

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "train.py", *FAST, *common, f"train.run_dir={killed}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step_00000006" / "meta.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its second checkpoint"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "checkpoints" / "step_00000010").exists()

    resumed = run_train(*common, f"train.run_dir={killed}")
    assert "resumed from" in resumed.stderr + resumed.stdout
    assert losses(killed) == expected  # bit-exact, every step


def test_resume_auto_ignores_incomplete_checkpoints(tmp_path):
    run_train("train.steps=2", "train.save_every=1", "train.eval_every=0", f"train.run_dir={tmp_path}")
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step_00000003.tmp").mkdir()  # a save that crashed midway
    (ckpts / "step_00000004").mkdir()  # no meta.json: incomplete
    proc = run_train("train.steps=3", "train.eval_every=0", f"train.run_dir={tmp_path}")
    assert "step_00000002 at step 2" in proc.stderr + proc.stdout


def test_corrupt_checkpoint_is_set_aside_under_auto_and_a_clear_error_as_a_path(tmp_path):
    run_train("train.steps=2", "train.save_every=1", "train.eval_every=0", f"train.run_dir={tmp_path}")
    newest = tmp_path / "checkpoints" / "step_00000002"
    for f in newest.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # the measurement
    explicit = run_train("train.steps=3", f"train.run_dir={tmp_path}", f"train.resume={newest}", check=False)
    assert explicit.returncode != 0
    assert "is corrupt" in explicit.stderr and "distcp" in explicit.stderr and "train.resume" in explicit.stderr
    auto = run_train("train.steps=3", "train.eval_every=0", f"train.run_dir={tmp_path}")  # a requeued job
    out = auto.stderr + auto.stdout
    assert "step_00000002 is corrupt" in out and "set aside as step_00000002.corrupt" in out
    assert "step_00000001 at step 1" in out


def test_unwritable_run_dir_is_one_clear_message(tmp_path):
    (tmp_path / "a_file").write_text("")
    proc = run_train(f"train.run_dir={tmp_path / 'a_file' / 'run'}", check=False)
    assert proc.returncode != 0
    assert "train.run_dir=" in proc.stderr and "set train.run_dir to a writable directory" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("override, message", [
    ("model=nope", "nope"),
    ("model.dim=130", "num_heads"),
    ("model.moe.top_k=9", "top_k"),
    ("data.source=files", "paths"),
    ("+model.moe.topk=4", "Key 'topk' not in 'MoEConfig'"),  # the append form Hydra suggests, no longer ignored
])
def test_bad_input_fails_with_one_clear_message(override, message, tmp_path):
    proc = run_train(override, f"train.run_dir={tmp_path}", check=False)
    assert proc.returncode != 0 and message in proc.stderr


def test_init_from_starts_at_the_given_weights(tmp_path):
    run_train("train.steps=20", "optim.warmup_steps=2", "train.log_every=20", "train.eval_every=0",
              f"train.run_dir={tmp_path / 'a'}")
    trained = losses(tmp_path / "a")[20]
    fresh = run_train("train.steps=1", "train.log_every=1", "train.eval_every=0", f"train.run_dir={tmp_path / 'b'}")
    warm = run_train("train.steps=1", "train.log_every=1", "train.eval_every=0", f"train.run_dir={tmp_path / 'c'}",
                     f"train.init_from={tmp_path / 'a'}")
    assert fresh.returncode == warm.returncode == 0
    assert losses(tmp_path / "c")[1] < losses(tmp_path / "b")[1] - 1.0
    assert abs(losses(tmp_path / "c")[1] - trained) < 0.5
    bad = run_train("train.steps=1", "model.num_layers=3", f"train.run_dir={tmp_path / 'd'}",
                    f"train.init_from={tmp_path / 'a'}", check=False)
    assert bad.returncode != 0 and "train.init_from" in bad.stderr


def test_periodic_lm_eval_is_logged(tmp_path):
    run_train("train.steps=2", "train.log_every=1", "train.eval_every=0", "train.lm_eval_every=2",
              "train.lm_eval_limit=4", f"train.run_dir={tmp_path}")
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "lm_eval/sonic_world/acc" not in recs[0]
    acc = recs[1]["lm_eval/sonic_world/acc"]
    assert 0.0 <= acc <= 1.0


def test_wandb_offline_logs_without_network(tmp_path):
    run_train("train.steps=2", "train.log_every=1", "train.eval_every=0", "wandb.mode=offline",
              f"train.run_dir={tmp_path}")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert any(runs[0].glob("*.wandb"))  # the run's event log, to `wandb sync` later
