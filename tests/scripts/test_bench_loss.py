"""bench.loss on CPU (its smoke mode): every part is timed and the JSON says what was measured."""
import json

import pytest

from bench import loss


def test_loss_times_each_part(tmp_path):
    out = tmp_path / "loss.json"
    loss.main(["--device", "cpu", "--tokens", "64", "--dim", "8", "--vocab", "300", "--steps", "1", "--warmup", "0",
               "--json", str(out)])
    r = json.loads(out.read_text())
    assert set(r["ms"]) == {"ce chunk, torch", "head gradient sum, bf16 GEMM + fp32 add",
                            "chunked loss, forward + backward"} and all(v > 0 for v in r["ms"].values())
    assert r["chunk_tokens"] == 64 and r["vocab"] == 300  # one chunk holds every token at this vocabulary


def test_loss_without_a_gpu_says_how_to_smoke_test():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="--device cpu"):
        loss.main([])
