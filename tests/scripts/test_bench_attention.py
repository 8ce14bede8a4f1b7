"""bench.attention on the CPU: each core is checked against fp32 SDPA and timed, or recorded with why it cannot
run here."""
import json

from bench import attention


def test_the_bench_checks_times_and_records_each_core_on_cpu(tmp_path):
    out = tmp_path / "a.json"
    attention.main(["--device", "cpu", "--shape", "1,64,4,2,16", "--cores", "sdpa,fa4", "--rounds", "2",
                    "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["shape"] == [1, 64, 4, 2, 16] and r["command"] and r["commit"]
    sdpa, fa4 = r["records"]
    assert sdpa["core"] == "sdpa" and sdpa["fwd_ms"] > 0 and sdpa["fb_ms"] > 0 and sdpa["fb_over_sdpa"] == 1.0
    assert len(sdpa["rounds_fb_ms"]) == 2
    assert set(sdpa["rel_err"]) == {"out", "dq", "dk", "dv"} and max(sdpa["rel_err"].values()) < 1e-2
    assert "fa4 cannot run here: it needs a CUDA GPU" in fa4["error"] and "fwd_ms" not in fa4
