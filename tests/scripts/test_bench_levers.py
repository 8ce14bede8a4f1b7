"""bench.levers on CPU (its smoke mode): each lever runs the real step and reports its numbers."""
import json

import pytest

from bench import levers


def test_levers_run_and_report(tmp_path):
    out = tmp_path / "levers.json"
    levers.main(["--device", "cpu", "--model", "tiny", "--layers", "1", "--backend", "reference", "--batch", "2x32",
                 "--steps", "1", "--warmup", "0", "--levers", "before,+ chunked loss,liger loss", "--json", str(out)])
    rows = {r["lever"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["before"]["fp32_router"] and rows["before"]["model"]["loss_backend"] == "torch"
    row = rows["+ chunked loss"]
    assert row["tokens_per_s"] > 0
    # tiny: E 8, K 2; each MoE layer routes every token of the 2x32 batch to K experts
    [load_E] = row["expert_load"]
    assert len(load_E) == 8 and sum(load_E) == 2 * 32 * 2
    assert row["max_load_over_mean"] == pytest.approx(max(load_E) / (sum(load_E) / len(load_E)))
    assert "CUDA" in rows["liger loss"]["skipped"]  # an unavailable backend is reported, not fatal
