"""bench.levers on CPU (its smoke mode): each lever runs the real step and reports its numbers."""
import json

from bench import levers


def test_levers_run_and_report(tmp_path):
    out = tmp_path / "levers.json"
    levers.main(["--device", "cpu", "--model", "tiny", "--layers", "1", "--backend", "reference", "--batch", "2x32",
                 "--steps", "1", "--warmup", "0", "--levers", "before,+ chunked loss,liger loss", "--json", str(out)])
    rows = {r["lever"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["before"]["fp32_router"] and rows["before"]["model"]["loss_backend"] == "torch"
    assert rows["+ chunked loss"]["tokens_per_s"] > 0 and rows["+ chunked loss"]["max_load_over_mean"] >= 1
    assert "CUDA" in rows["liger loss"]["skipped"]  # an unavailable backend is reported, not fatal
