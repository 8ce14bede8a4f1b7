"""bench.train_step on CPU (its smoke mode): every phase is timed and the JSON adds up."""
import json

import pytest

from bench import train_step


def test_train_step_times_every_phase_and_both_optimizers(tmp_path):
    out = tmp_path / "ts.json"
    train_step.main(["--device", "cpu", "--model", "tiny", "--layers", "1", "--backend", "reference",
                     "--batch", "2x32", "--steps", "1", "--warmup", "0", "--json", str(out)])
    r = json.loads(out.read_text())
    ms = r["phases_ms"]
    assert set(ms) == {"forward (model + loss)", "forward + backward", "clip_grad_norm (in place)",
                       "clip + AdamW step, foreach", "clip + AdamW step, fused"} and all(v > 0 for v in ms.values())
    for impl in ("foreach", "fused"):
        step = r["steps"][impl]
        assert step["step_ms"] == pytest.approx(ms["forward + backward"] + ms[f"clip + AdamW step, {impl}"])
        assert step["tokens_per_s"] == pytest.approx(64 / step["step_ms"] * 1e3)
    assert r["kernels"] and r["batch"] == [2, 32]


def test_train_step_without_a_gpu_says_how_to_smoke_test():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="--device cpu"):
        train_step.main([])


def test_train_step_times_only_the_optimizers_asked_for(tmp_path):
    """Each AdamW implementation keeps its own state; `--optimizers fused` times one (the 40-layer sonic_7b holds
    only one on an H200), and an unknown name is refused."""
    out = tmp_path / "ts.json"
    args = ["--device", "cpu", "--model", "tiny", "--layers", "1", "--backend", "reference", "--batch", "2x16",
            "--steps", "1", "--warmup", "0", "--json", str(out)]
    train_step.main([*args, "--optimizers", "fused"])
    r = json.loads(out.read_text())
    assert list(r["steps"]) == ["fused"]
    assert "clip + AdamW step, fused" in r["phases_ms"] and "clip + AdamW step, foreach" not in r["phases_ms"]
    with pytest.raises(SystemExit, match="subset of foreach,fused,triton"):
        train_step.main([*args, "--optimizers", "fused,adafactor"])
    with pytest.raises(SystemExit, match="triton needs a CUDA GPU"):
        train_step.main([*args, "--optimizers", "triton"])
