"""bench.peer_titan: the peer harness runs Sonic's side on real batches and appends a like-for-like row; the titan
side without torchtitan is one clear error (on the CPU: gloo, the reference experts, timings meaningless)."""
import importlib.util
import json

import pytest

from bench import peer_titan


def test_sonic_side_appends_a_like_for_like_row(tmp_path):
    out = tmp_path / "peer.jsonl"
    args = ["--which", "sonic", "--device", "cpu", "--layers", "1", "--batch", "2x32", "--data", "embedded",
            "--backend", "reference", "--steps", "1", "--warmup", "1", "--jsonl", str(out)]
    peer_titan.main(args)
    peer_titan.main(args)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2
    row = rows[0]
    assert row["which"] == "sonic" and row["like_for_like"] is True and row["compile"] is False
    assert row["data"] == "embedded" and row["batch"] == "2x32" and row["tokens_per_s"] > 0
    assert row["attention"] == "sdpa"  # auto's choice off a GPU
    assert row["loss"] == rows[1]["loss"] and 0 < row["loss"] < 30  # the same seed and batches: the same loss
    assert "kernels" not in row and "host" not in row
    assert len(row["step_ms_all"]) == 1 and row["step_ms_best"] == row["step_ms_all"][0]


def test_kernels_lists_a_profiled_steps_slowest_ops(tmp_path):
    out = tmp_path / "peer.jsonl"
    peer_titan.main(["--which", "sonic", "--device", "cpu", "--layers", "1", "--batch", "2x32", "--data", "embedded",
                     "--backend", "reference", "--steps", "1", "--warmup", "1", "--jsonl", str(out), "--kernels", "5"])
    kernels = json.loads(out.read_text())["kernels"]
    assert len(kernels) == 5 and all(k["ms"] > 0 and k["count"] >= 1 for k in kernels)
    assert [k["ms"] for k in kernels] == sorted((k["ms"] for k in kernels), reverse=True)
    assert any("mm" in k["name"] for k in kernels)  # the step's matmuls are among its slowest ops


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is not None, reason="torchtitan is installed here")
def test_titan_side_without_torchtitan_names_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="cannot import torchtitan from .*unpack torchtitan==0.3.0"):
        peer_titan.main(["--which", "titan", "--device", "cpu", "--titan-path", str(tmp_path), "--layers", "1",
                         "--jsonl", str(tmp_path / "peer.jsonl")])


def test_set_overrides_sonics_model_and_is_recorded(tmp_path):
    out = tmp_path / "peer.jsonl"
    base = ["--which", "sonic", "--device", "cpu", "--layers", "1", "--batch", "2x32", "--data", "embedded",
            "--backend", "reference", "--steps", "1", "--warmup", "0", "--jsonl", str(out)]
    peer_titan.main(base)
    peer_titan.main([*base, "--set", "moe.expert_dim=128", "--set", "moe.routing.logit_norm=none"])
    plain, cut = (json.loads(line) for line in out.read_text().splitlines())
    assert plain["sets"] == [] and cut["sets"] == ["moe.expert_dim=128", "moe.routing.logit_norm=none"]
    assert plain["params"] - cut["params"] == 3 * 128 * 128 * 1536  # one layer's experts, n 256 -> 128
    with pytest.raises(SystemExit):  # Sonic's overrides on torchtitan's side: refused before anything is built
        peer_titan.main(["--which", "titan", "--device", "cpu", "--set", "attention_backend=sdpa"])
    with pytest.raises(SystemExit):  # the host against the GPU: no GPU, no measurement
        peer_titan.main([*base, "--host", "3"])
