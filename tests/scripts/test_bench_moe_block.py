"""bench.moe_layer --block on CPU (its smoke mode): the training MoE block runs and its record has every field."""
import json

from bench import moe_layer

REQUIRED = {"gpu": str, "config": str, "backend": str, "fwd_tflops": float, "bwd_tflops": float, "fb_tflops": float,
            "held_mib": type(None), "official_fb_tflops": type(None), "official_held_mib": type(None),
            "ratio_fb": type(None), "compile_s": float}


def test_block_bench_cpu_record(tmp_path):
    out = tmp_path / "moe_block.json"
    moe_layer.main(["--block", "--device", "cpu", "--shape", "64,32,16,4,2", "--rounds", "3", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload["mode"] == "block" and payload["official_unavailable"] == "--device cpu"
    [rec] = payload["records"]
    assert "error" not in rec, rec.get("trace")
    for field, kind in REQUIRED.items():
        if field == "bwd_tflops" and rec[field] is None:  # fb - fwd of noisy CPU timings can be <= 0
            continue
        assert isinstance(rec[field], kind), (field, rec[field])
    assert (rec["gpu"], rec["config"], rec["backend"]) == ("cpu", "64,32,16,4,2", "reference")
    assert rec["fwd_tflops"] > 0 and rec["fb_tflops"] > 0 and rec["compile_s"] > 0
    assert rec["bwd_tflops"] is None or rec["bwd_tflops"] > 0
    # the block is checked against itself on the reference backend: the same routing, so exact
    assert rec["check_ok"] and rec["max_err"] == 0 and set(rec["check"]) == {"out", "dx", "dw1", "dw2", "drouter"}
    assert len(rec["rounds_ms"]["fwd"]) == len(rec["rounds_ms"]["fb"]) == 3


def test_block_bench_resume_skips_done_records(tmp_path, capsys):
    out = tmp_path / "moe_block.json"
    args = ["--block", "--device", "cpu", "--shape", "32,16,8,4,2", "--rounds", "1", "--json", str(out)]
    moe_layer.main(args)
    first = json.loads(out.read_text())["records"]
    moe_layer.main(args + ["--resume"])
    assert "already in the results" in capsys.readouterr().out
    assert json.loads(out.read_text())["records"] == first


def test_table_9b_configs_are_named():
    from scripts.repro import paper

    want = [shape for shapes in paper.TABLE_9B.values() for shape in shapes]
    assert [moe_layer.CONFIGS[c] for c in moe_layer.TABLE_9B] == want
