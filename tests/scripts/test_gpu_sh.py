"""bench/gpu.sh's cute cache fill: before the GPU tests, every kernel the carried cache names is compiled for this
tree's sources on all cores (bench.cute_cache --from), and nothing runs without a carried cache or a CuTe DSL."""
import os
import re
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_fill(tmp_path: Path, carried: bool, dsl: bool) -> tuple[list[str], str]:
    """(the python3 calls, the log) of fill_cute_cache from gpu.sh, run in tmp_path with a python3 stub that records
    its arguments and imports the DSL or not."""
    script = (ROOT / "bench" / "gpu.sh").read_text()
    body = re.search(r"^fill_cute_cache\(\) \{.*?^\}", script, re.S | re.M).group(0)
    stub_dir, calls = tmp_path / "bin", tmp_path / "calls"
    stub_dir.mkdir()
    stub = stub_dir / "python3"
    stub.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n[ "$1" = -c ] && exit {0 if dsl else 1}\n'
                    'echo "204 kernels in X (0 compiled, 204 already there), 2s with 4 process(es)"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    if carried:
        (tmp_path / ".cute_cache").mkdir()
    log = tmp_path / "steps.log"
    subprocess.run(["bash", "-c", f'log() {{ echo "$*" >> {log}; }}\n{body}\nfill_cute_cache'], cwd=tmp_path,
                   check=True, env={**os.environ, "PATH": f"{stub_dir}:{os.environ['PATH']}",
                                    "SONIC_CUTE_CACHE_DIR": str(tmp_path / "cache")})
    return (calls.read_text().splitlines() if calls.exists() else [], log.read_text() if log.exists() else "")


def test_a_carried_cache_is_filled_for_this_tree_on_every_core(tmp_path):
    calls, log = run_fill(tmp_path, carried=True, dsl=True)
    assert calls[0] == "-c import cutlass"
    *args, jobs = calls[1].split()
    assert args == ["-m", "bench.cute_cache", "--out", str(tmp_path / "cache"), "--from", ".cute_cache", "--jobs"]
    assert int(jobs) >= 1  # nproc: every core the machine gives this process
    assert "cute compile cache: 204 kernels" in log


def test_nothing_runs_without_a_carried_cache(tmp_path):
    assert run_fill(tmp_path, carried=False, dsl=True) == ([], "")


def test_nothing_is_compiled_without_the_cute_dsl(tmp_path):
    assert run_fill(tmp_path, carried=True, dsl=False) == (["-c import cutlass"], "")


def test_the_smoke_and_the_gpu_tests_fill_it_first():
    script = (ROOT / "bench" / "gpu.sh").read_text()
    for stage in ("smoke", "tests"):
        assert re.search(rf"^    {stage}\)\n      fill_cute_cache\n", script, re.M), stage
