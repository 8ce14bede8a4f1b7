"""bench.routing on CPU: it times the torch routing backend, checks the plans agree and writes its JSON."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_routing_bench_writes_records(tmp_path):
    out = tmp_path / "routing.json"
    proc = subprocess.run([sys.executable, "-m", "bench.routing", "--shape", "256,16,4", "--backends", "torch", "--methods", "topk,token_rounding",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    assert [r["method"] for r in records] == ["topk", "token_rounding"]
    for rec in records:
        assert rec["backend"] == "torch" and rec["shape"] == [256, 16, 4] and rec["plans_equal"] is True
        assert 0 < rec["fwd_ms"] and 0 < rec["fb_ms"]


def test_select_tiles_sweep_checks_and_records_each_config(tmp_path):
    """--select-tiles runs the triton route (in Triton's interpreter here) under each tile config beside the
    default, and records every config's kernel time and whether its outputs matched the default's."""
    import importlib.util
    import os

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    out = tmp_path / "routing.json"
    proc = subprocess.run([sys.executable, "-m", "bench.routing", "--shape", "64,16,4", "--backends", "torch",
                           "--methods", "topk", "--select-tiles", "8,2,4/32,1,2", "--profile-calls", "1",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (sweep,) = json.loads(out.read_text())["select_tiles"]
    assert sweep["shape"] == [64, 16, 4] and list(sweep["configs"]) == ["default", "8,2,4", "32,1,2"]
    assert sweep["configs"]["32,1,2"]["config"]["BT"] == 32 and sweep["configs"]["32,1,2"]["config"]["SUB"] == 1
    for row in sweep["configs"].values():
        assert row["plan_equal"] is True and len(row["rounds_us"]) == 3 and row["us_per_call"] >= 0


def test_profile_records_each_routes_kernels(tmp_path):
    """--profile adds, per backend and method, the route's kernels per call for the forward and the
    forward+backward (CPU ops' self time off a GPU), their total the sum of the listed kernels."""
    out = tmp_path / "routing.json"
    proc = subprocess.run([sys.executable, "-m", "bench.routing", "--shape", "64,16,4", "--backends", "torch",
                           "--profile", "--profile-calls", "2", "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    assert {r["method"] for r in records} == {"topk", "token_rounding"}
    for rec in records:
        for phase in ("fwd", "fb"):
            k = rec["kernels"][phase]
            assert k["top"] and k["us_per_call"] > 0
            assert abs(k["us_per_call"] - sum(us for _, us, _ in k["top"])) < 1e-6 * k["us_per_call"]
