"""bench/energy.py: NVML's device numbering under CUDA_VISIBLE_DEVICES, the sustained loop's arithmetic on a counter
whose readings are known, the refusal where there is no NVML, and (GPU) real readings of a held matmul."""
import time

import pytest
import torch

from bench import energy


def test_nvml_index_follows_cuda_visible_devices():
    assert energy.nvml_index(0, None) == 0 and energy.nvml_index(1, "") == 1
    assert energy.nvml_index(0, "3,1") == 3 and energy.nvml_index(1, "3, 1") == 1
    assert energy.nvml_index(0, "GPU-5f2c") == 0  # UUIDs are not mapped


class FakeNvml:
    """An energy counter that rises 2 J per call of `tick`, a fixed clock and power."""
    def __init__(self):
        self.mj = 10_000

    def tick(self):
        self.mj += 2_000

    def energy_mj(self):
        return self.mj

    def sm_mhz(self):
        return 1500

    def power_w(self):
        return 650.0


def test_sustained_divides_the_counter_by_the_calls_and_the_wall_time():
    nvml = FakeNvml()

    def fn():
        nvml.tick()
        time.sleep(0.001)

    r = energy.sustained(fn, nvml, seconds=0.05, warmup_s=0.01, batch=4, sync=lambda: None)
    assert r["calls"] >= 4 and r["calls"] % 4 == 0
    assert r["joules_per_call"] == pytest.approx(2.0)
    assert r["watts"] == pytest.approx(2.0 * r["calls"] / (r["calls"] * r["ms"] / 1e3))
    assert r["ms"] >= 1.0 and r["sm_mhz_median"] == r["sm_mhz_min"] == 1500 and r["power_w_median"] == 650.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine has NVML; the GPU test covers it")
def test_open_names_why_there_is_no_nvml():
    with pytest.raises(energy.NvmlUnavailable, match="NVML"):
        energy.Nvml.open()


@pytest.mark.gpu
def test_a_held_matmul_reads_energy_clock_and_power():
    nvml = energy.Nvml.open(torch.cuda.current_device())
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    r = energy.sustained(lambda: a @ a, nvml, seconds=0.5, warmup_s=0.1)
    assert r["joules_per_call"] > 0 and 10 < r["watts"] < 2000, r
    assert 100 < r["sm_mhz_median"] < 4000 and r["ms"] > 0, r
