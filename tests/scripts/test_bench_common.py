"""bench.common.write_json records the commit the numbers were measured at: $SONIC_COMMIT where it is set (the
GPU machine's copy of the tree may carry a stale .git), else git's HEAD in a checkout (HEAD+modified where tracked
files differ from it), else "unknown"; a payload's own wins."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import common


@pytest.fixture
def no_git_here(tmp_path, monkeypatch):
    """REPO is a plain folder (as on the GPU machine), with no repository above it either."""
    monkeypatch.setattr(common, "REPO", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("SONIC_COMMIT", raising=False)
    monkeypatch.delenv("OUT", raising=False)


def written(tmp_path, payload=None) -> dict:
    path = common.write_json(tmp_path / "out" / "result.json", payload or {"x": 1})
    return json.loads(path.read_text())


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_checkout_records_its_head_and_whether_its_files_differ(tmp_path, monkeypatch, no_git_here):
    """A checkout records its HEAD; with tracked files changed since (a run before its commit, or the GPU machine's
    copy of a newer tree beside a stale .git) it records HEAD+modified, which names no commit."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "kernel.py").write_text("a = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "kernel.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    monkeypatch.setattr(common, "REPO", repo)
    assert written(tmp_path)["commit"] == head
    (repo / "untracked.txt").write_text("not the tree's\n")  # untracked files are not the tree
    assert written(tmp_path)["commit"] == head
    (repo / "kernel.py").write_text("a = 2\n")
    assert written(tmp_path)["commit"] == f"{head}+modified"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_environment_names_the_commit_over_a_checkouts_head(tmp_path, monkeypatch):
    """On the GPU machine the copy carried the session's first .git: its HEAD was not the tree that ran."""
    monkeypatch.setenv("SONIC_COMMIT", "fromenv")
    monkeypatch.delenv("OUT", raising=False)
    assert written(tmp_path)["commit"] == "fromenv"


def test_without_git_the_environment_names_the_commit(tmp_path, monkeypatch, no_git_here):
    monkeypatch.setenv("SONIC_COMMIT", "abc1234")
    assert written(tmp_path)["commit"] == "abc1234"


def test_without_git_or_environment_the_commit_is_unknown(tmp_path, no_git_here):
    assert written(tmp_path)["commit"] == "unknown"


def test_a_payloads_own_commit_wins(tmp_path, monkeypatch, no_git_here):
    monkeypatch.setenv("SONIC_COMMIT", "abc1234")
    got = written(tmp_path, {"commit": "0123456789abcdef", "x": 1})
    assert got["commit"] == "0123456789abcdef" and got["x"] == 1


def test_a_repository_around_a_copy_is_not_its_commit(tmp_path, monkeypatch, no_git_here):
    """A tree copied into some other repository's folder is not that repository's HEAD."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    outer = tmp_path / "outer"
    (outer / "copy").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    subprocess.run(["git", "-C", str(outer), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q",
                    "--allow-empty", "-m", "outer"], check=True)
    monkeypatch.setattr(common, "REPO", outer / "copy")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.setenv("SONIC_COMMIT", "abc1234")
    assert written(tmp_path)["commit"] == "abc1234"


def test_gpu_gaps_splits_idle_time_by_whether_the_host_had_queued_the_next_op():
    """A trace as torch.profiler exports it (microseconds): k1 0-10, k2 queued at 5 runs 12-20 (a 2 us gap,
    queued), k3 queued only at 118 (the host's call ends after k2) runs 120-130 (100 us, host-bound), a memset
    overlapping k3 adds no idle, and a copy with no launch record after a 20 us gap."""
    def op(name, ts, dur, corr=None, cat="kernel"):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {} if corr is None else {"correlation": corr}}

    def launch(ts, dur, corr):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [op("k1", 0, 10, 1), launch(0, 3, 1), op("k2", 12, 8, 2), launch(5, 3, 2), op("k3", 120, 10, 3),
              launch(110, 8, 3), op("Memset", 125, 2, 4, "gpu_memset"), launch(100, 2, 4),
              op("Memcpy", 150, 10, cat="gpu_memcpy"), {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]
    g = common.gpu_gaps(events)
    assert g["span_ms"] == pytest.approx(0.160) and g["busy_ms"] == pytest.approx(0.038)
    assert g["idle_ms"] == pytest.approx(0.122) and g["idle_host_bound_ms"] == pytest.approx(0.100)
    assert g["idle_unlinked_ms"] == pytest.approx(0.020)
    assert g["idle_ms_by_gap"] == pytest.approx({"under 5 us": 0.002, "5 to 100 us": 0.020, "100 us or more": 0.100})
    assert g["largest"][0] == {"ms": pytest.approx(0.1), "after": "k2", "before": "k3", "why": "host_bound"}
    assert [(x["op"], x["why"]) for x in g["idle_before"]] == [("k3", "host_bound"), ("Memcpy", "unlinked"),
                                                               ("k2", "queued")]
    assert common.gpu_gaps([events[-1]]) == {}


def test_only_results_under_bench_results_go_back_to_out(tmp_path, monkeypatch):
    """On the GPU machine $OUT is what comes back: the results the call made, not a test's temporary files."""
    out, results = tmp_path / "out_dir", tmp_path / "repo" / "bench" / "results"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setattr(common, "RESULTS", results)
    common.write_json(results / "2026-01-01-h100-x.json", {"x": 1})
    common.write_json(tmp_path / "elsewhere" / "y.json", {"y": 1})
    assert sorted(p.name for p in out.iterdir()) == ["2026-01-01-h100-x.json"]


def test_the_recorded_command_reruns_a_script_by_path_and_a_module_by_name(tmp_path):
    """A script run by its path is recorded as that path (`python3 bench/cute_gemm.py ...`), not as `-m <file
    name>`, which would not run; a module keeps its `-m` name."""
    repo = Path(common.__file__).resolve().parents[1]
    (tmp_path / "pkg").mkdir()
    code = "from bench.common import command_line; print(command_line())\n"
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "tool.py").write_text(code)
    env = {"PYTHONPATH": f"{repo}:{tmp_path}", "PATH": "/usr/bin:/bin"}

    def run(*args):
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True, env=env,
                              cwd=tmp_path).stdout.strip()

    assert run("pkg/tool.py", "--shape", "7b").split()[1:] == ["pkg/tool.py", "--shape", "7b"]
    assert run("-m", "pkg.tool", "--x", "1").split()[1:] == ["-m", "pkg.tool", "--x", "1"]
