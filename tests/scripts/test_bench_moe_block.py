"""bench.moe_block on CPU (its smoke mode): the training MoE block runs and its record has every field;
the official layer's path runs on a stand-in with sonic-moe's interface."""
import argparse
import json
import types

import pytest
import torch

from bench import moe_block, moe_configs, moe_layer

REQUIRED = {"gpu": str, "config": str, "backend": str, "fwd_tflops": float, "bwd_tflops": float, "fb_tflops": float,
            "held_mib": type(None), "official_fb_tflops": type(None), "official_held_mib": type(None),
            "ratio_fb": type(None), "compile_s": float}


def test_block_bench_cpu_record(tmp_path):
    out = tmp_path / "moe_block.json"
    moe_block.main(["--device", "cpu", "--shape", "64,32,16,4,2", "--rounds", "3", "--json", str(out)])
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
    assert "64,32,16,4,2" not in moe_configs.CONFIGS  # an extra shape is the run's, not the module's


def test_block_bench_resume_skips_done_records(tmp_path, capsys):
    out = tmp_path / "moe_block.json"
    args = ["--device", "cpu", "--shape", "32,16,8,4,2", "--rounds", "1", "--json", str(out)]
    moe_block.main(args)
    first = json.loads(out.read_text())["records"]
    moe_block.main(args + ["--resume"])
    assert "already in the results" in capsys.readouterr().out
    assert json.loads(out.read_text())["records"] == first


class _StandInOfficial(torch.nn.Module):
    """sonic-moe's MoE interface (router, c_fc, c_proj; forward -> (out, aux)) on Sonic's reference kernels."""

    def __init__(self, num_experts, num_experts_per_tok, hidden_size, intermediate_size, activation_function,
                 add_bias, std):
        super().__init__()
        E, K, d, n = num_experts, num_experts_per_tok, hidden_size, intermediate_size
        self.K = K
        self.router = torch.nn.Linear(d, E, bias=False)
        self.c_fc, self.c_proj = torch.nn.Module(), torch.nn.Module()
        self.c_fc.weight = torch.nn.Parameter(torch.empty(E, 2 * n, d))
        self.c_proj.weight = torch.nn.Parameter(torch.empty(E, d, n))

    def forward(self, x_TD):
        from sonic.kernels import reference
        from sonic.routing.plan import plan_from_topk

        logits_TE = torch.nn.functional.linear(x_TD, self.router.weight).float()
        top, idx = logits_TE.topk(self.K, dim=-1)
        plan = plan_from_topk(idx, top.softmax(-1), logits_TE.shape[1])
        return reference.experts(x_TD, self.c_fc.weight, self.c_proj.weight, plan), logits_TE.softmax(-1).var()


def test_block_bench_official_fields_with_a_stand_in(monkeypatch):
    """The official path (built on the same weights, timed interleaved, compared) without a GPU."""
    official = (_StandInOfficial, types.SimpleNamespace(SWIGLU="swiglu"))
    args = argparse.Namespace(device="cpu", model="sonic_7b", rounds=2, warmup=1, rep=1)
    records = []
    moe_block.run_block_config("tiny", (48, 32, 16, 4, 2), ["reference"], official, args, set(), records.append)
    [rec] = records
    assert "error" not in rec, rec.get("trace")
    assert rec["official_fb_tflops"] > 0 and rec["official_compile_s"] > 0 and rec["official_held_mib"] is None
    assert rec["ratio_fb"] == rec["fb_tflops"] / rec["official_fb_tflops"]
    assert rec["official_err_out"] < 1e-2  # same weights, same top-K + softmax routing
    assert list(rec["rounds_ms"]) == ["fwd", "official_fwd", "fb", "official_fb"]  # interleaved


def test_moe_layer_block_points_to_the_block_module(capsys):
    with pytest.raises(SystemExit):
        moe_layer.main(["--block", "--device", "cpu", "--shape", "64,32,16,4,2"])
    assert "python -m bench.moe_block" in capsys.readouterr().err
