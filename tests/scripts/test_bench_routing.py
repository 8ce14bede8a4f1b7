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
