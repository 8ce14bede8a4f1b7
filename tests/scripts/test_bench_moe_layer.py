"""bench.moe_layer on CPU (its smoke mode): the bare layer runs, is checked against the fp32 reference, and a
run's --shape and --sweep-shape stay the run's (the module's tables are left as they were)."""
import json

from bench import moe_configs, moe_layer


def test_layer_bench_cpu_record(tmp_path):
    out, sparse = tmp_path / "moe_layer.json", dict(moe_layer.SPARSE)
    moe_layer.main(["--device", "cpu", "--shape", "64,32,16,4,2", "--backends", "reference", "--no-official",
                    "--sweep-shape", "256,32,16,2,4,8", "--json", str(out)])
    payload = json.loads(out.read_text())
    [config] = payload["configs"]
    assert (config["config"], config["shape"]) == ("64,32,16,4,2", [64, 32, 16, 4, 2])
    rec = config["backends"]["reference"]
    assert "error" not in rec, rec.get("trace")
    assert rec["check_ok"] and set(rec["check"]) == {"out", "dx", "dw1", "dw2"}
    assert rec["held_bytes"] is None and rec["fwd_tf"] > 0 and rec["fwdbwd_tf"] > 0  # no CUDA allocator to ask
    assert payload["sweep_shape"] == [256, 32, 16, 2] and payload["official_h100"]["7B"]["fwdbwd"] == 361
    assert moe_layer.SPARSE == sparse and "64,32,16,4,2" not in moe_configs.CONFIGS
