"""wandb continues the same run across a resume (offline mode: no network)."""
import pytest

from tests.train.test_faults import run

pytest.importorskip("wandb")


def run_ids(run_dir) -> list[str]:
    """The run id of each wandb run written offline under run_dir, from its log run-<id>.wandb: the folder,
    offline-run-<time>-<id>, gains a suffix (-1) when a resume starts within the same second as its run."""
    return [next(p.glob("run-*.wandb")).stem.removeprefix("run-")
            for p in sorted((run_dir / "wandb").glob("offline-run-*"))]


def test_a_resumed_run_logs_to_the_same_wandb_run(tmp_path):
    """The issue: each resume started a new wandb run."""
    common = ["wandb.mode=offline", "train.save_every=2"]
    run(tmp_path, *common, "train.steps=2")
    stored = (tmp_path / "wandb_run_id").read_text().strip()
    run(tmp_path, *common, "train.steps=4")  # resumes from step 2
    assert run_ids(tmp_path) == [stored, stored]
    run(tmp_path, *common, "train.steps=2", "train.resume=none")  # a fresh start is a new run
    new = (tmp_path / "wandb_run_id").read_text().strip()
    assert new != stored and sorted(run_ids(tmp_path)) == sorted([stored, stored, new])
