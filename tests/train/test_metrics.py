"""speed_metrics: MFU counted with causal attention (the headline) and with full attention beside it."""
import pytest
import torch

from sonic.models import training_flops
from sonic.train.metrics import speed_metrics
from tests.helpers import compose_config


def test_speed_metrics_reports_causal_and_full_mfu():
    flops = training_flops(compose_config("model=sonic_7b").model, 4096)
    out = speed_metrics(30_000.0, 2, flops, 989e12, torch.device("cpu"))
    assert out["tokens_per_s"] == 60_000.0 and out["btokens_per_day"] == pytest.approx(60_000 * 86400 / 1e9)
    assert out["mfu_causal"] == pytest.approx(30_000 * 8_145_773_568 / 989e12)
    assert out["mfu"] == pytest.approx(30_000 * 9_655_723_008 / 989e12)
    assert "mem_peak_gib" not in out  # CPU: no device memory counter


def test_speed_metrics_without_a_known_peak_has_no_mfu():
    flops = training_flops(compose_config("model=tiny").model, 128)
    out = speed_metrics(1000.0, 1, flops, None, torch.device("cpu"))
    assert "mfu" not in out and "mfu_causal" not in out


def test_trainer_logs_both_mfus(tmp_path):
    from sonic.train.trainer import train

    cfg = compose_config("model.num_layers=2", "train.micro_batch_size=2", "train.seq_len=64", "train.steps=2",
                         "train.log_every=1", "train.eval_every=0", "train.save_every=0", "train.progress=false",
                         "train.peak_tflops=1", f"train.run_dir={tmp_path}")
    flops = training_flops(cfg.model, 64)
    [*_, last] = train(cfg)
    assert last["mfu_causal"] == pytest.approx(last["tokens_per_s_per_gpu"] * flops.causal / 1e12)
    assert last["mfu"] == pytest.approx(last["tokens_per_s_per_gpu"] * flops.full / 1e12)


@pytest.mark.gpu
def test_speed_metrics_reports_the_allocator_on_a_gpu():
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats(device)
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)  # 64 MiB held by the caching allocator
    out = speed_metrics(1000.0, 1, training_flops(compose_config("model=tiny").model, 128), None, device)
    del x
    assert out["mem_peak_gib"] >= 1 / 16 and out["mem_reserved_gib"] >= out["mem_peak_gib"]
    assert out["alloc_retries"] == torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
