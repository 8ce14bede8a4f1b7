"""bench.smoke on CPU: git's tree hash without git, and the landing rule it checks (a smoke result proves
HEAD's sonic/ tree only if its commit's sonic/ tree is HEAD's and nothing failed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import smoke

REPO = Path(__file__).resolve().parents[2]


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository with a sonic/ folder (nested dirs, an executable, names that sort differently as dirs)."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "sonic" / "kernels" / "cute").mkdir(parents=True)
    (tmp_path / "sonic" / "kernels.py").write_text("x = 1\n")  # sorts after the dir "kernels/" in git's order
    (tmp_path / "sonic" / "kernels" / "cute" / "gemm.py").write_text("y = 2\n")
    (tmp_path / "sonic" / "a-b.py").write_text("")
    script = tmp_path / "sonic" / "run.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "one")
    monkeypatch.setattr(smoke, "REPO", tmp_path)
    return tmp_path


def _result(repo: Path, name: str, **fields) -> Path:
    rec = {"commit": _git(repo, "rev-parse", "HEAD"), "sonic_tree": smoke.git_tree_hash(repo / "sonic"),
           "tests_failed": 0, "train": {"cute": {"rc": 0}, "triton": {"rc": 0}}, **fields}
    path = repo / name
    path.write_text(json.dumps(rec))
    return path


def test_tree_hash_is_gits(repo):
    (repo / "sonic" / "__pycache__").mkdir()
    (repo / "sonic" / "__pycache__" / "x.pyc").write_bytes(b"\0")  # what running Python leaves, ignored by git
    assert smoke.git_tree_hash(repo / "sonic") == _git(repo, "rev-parse", "HEAD:sonic")
    assert smoke.git_tree_hash(REPO / "sonic") != _git(repo, "rev-parse", "HEAD:sonic")


def test_a_result_proves_only_its_own_clean_tree(repo):
    assert smoke.verify(_result(repo, "ok.json")) is None
    assert "failed" in smoke.verify(_result(repo, "bad.json", tests_failed=2))
    assert "failed" in smoke.verify(_result(repo, "bad.json", train={"cute": {"rc": 1}}))
    assert "ran past --tests-timeout" in smoke.verify(_result(repo, "slow.json", tests_failed=1, tests_rc=124,
                                                               tests_timed_out=True))
    assert "not in this repository" in smoke.verify(_result(repo, "x.json", commit="0" * 40))

    (repo / "sonic" / "kernels.py").write_text("x = 2\n")  # tested dirty: the tree is not the commit's
    dirty = _result(repo, "dirty.json")
    assert "dirty" in smoke.verify(dirty)

    ok = _result(repo, "ok.json")  # taken on a clean tree ...
    (repo / "sonic" / "kernels.py").write_text("x = 1\n")
    ok = _result(repo, "ok.json")
    (repo / "sonic" / "kernels.py").write_text("x = 3\n")
    _git(repo, "commit", "-qam", "two")  # ... and sonic/ changed after it
    assert "changed since" in smoke.verify(ok)
    (repo / "README.md").write_text("docs only\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "three")
    assert smoke.verify(_result(repo, "new.json")) is None  # a change outside sonic/ needs no new smoke


def test_smoke_refuses_to_run_without_a_gpu():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "-m", "bench.smoke", "--commit", "abc"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr


def test_a_gpu_test_run_past_its_timeout_is_a_named_failure(repo, tmp_path):
    (repo / "tests").mkdir()
    (repo / "tests" / "test_slow.py").write_text(
        "import time, pytest\n\n@pytest.mark.gpu\ndef test_slow():\n    print('started', flush=True)\n"
        "    time.sleep(60)\n")
    log = tmp_path / "tests.log"
    got = smoke.run_gpu_tests(3.0, log)
    assert got["tests_timed_out"] and got["tests_rc"] == 124 and got["tests_failed"] == 1
    assert got["tests_failures"][-1].startswith("TIMEOUT: pytest -m gpu ran past --tests-timeout 3 s")
    assert "timed out after 3 s" in log.read_text() and "b'" not in log.read_text()  # text, not a bytes repr


def test_verify_newest_takes_the_last_date_not_the_last_name(tmp_path):
    for name, date in (("2026-11-24-h100-smoke.json", "2026-11-24T13:17:58"),
                       ("2026-11-24-h200-smoke.json", "2026-11-24T12:02:02")):
        (tmp_path / name).write_text(json.dumps({"date": date}))
    assert smoke.newest(sorted(tmp_path.glob("*.json"))).name == "2026-11-24-h100-smoke.json"
    assert smoke.newest([]) is None


def test_a_command_past_its_timeout_keeps_its_partial_output_as_text(repo):
    out, rc, timed_out = smoke.run_command(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], 3.0)
    assert (rc, timed_out) == (124, True)
    assert out.startswith("started") and out.endswith("timed out after 3 s")  # text, not b'...'
