"""bench.block_profile on CPU (its smoke mode): the block's forward and forward+backward are profiled op by op."""
import json

import pytest

from bench import block_profile


def test_block_profile_lists_the_blocks_ops(tmp_path):
    out = tmp_path / "profile.json"
    block_profile.main(["--device", "cpu", "--shape", "64,32,16,4,2", "--iters", "1", "--eager", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["backend"] == "reference" and r["official_unavailable"] == "--device cpu"
    rec = r["configs"]["64,32,16,4,2"]
    assert set(rec) == {"shape", "sonic_fwd", "sonic_fb"}
    for what in ("sonic_fwd", "sonic_fb"):
        ops = rec[what]["kernels"]
        assert ops and all(k["ms"] >= 0 and k["launches"] > 0 for k in ops)
        assert [k["ms"] for k in ops] == sorted((k["ms"] for k in ops), reverse=True)
        assert rec[what]["kernel_ms"] == pytest.approx(sum(k["ms"] for k in ops))
    names = {k["name"] for k in rec["sonic_fb"]["kernels"]}
    assert any("mm" in n for n in names)  # the router and expert GEMMs are there
    assert len(names) > len({k["name"] for k in rec["sonic_fwd"]["kernels"]})  # the backward adds its own ops


def test_block_profile_without_a_gpu_says_how_to_smoke_test():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="--device cpu"):
        block_profile.main([])
