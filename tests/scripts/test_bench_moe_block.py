"""bench.moe_block on CPU (its smoke mode): the training MoE block runs and its record has every field;
the official layer's path runs on a stand-in with sonic-moe's interface. The timed callables really run,
interleaved; the ms they return are replaced by fixed ones, so each field's arithmetic is checked exactly."""
import argparse
import json
import types

import pytest
import torch

from bench import common, moe_block, moe_configs, moe_layer

REQUIRED = {"gpu": str, "config": str, "backend": str, "fwd_tflops": float, "bwd_tflops": float, "fb_tflops": float,
            "held_mib": type(None), "official_fb_tflops": type(None), "official_held_mib": type(None),
            "compile_s": float, "load_max_over_mean": float} | dict.fromkeys(moe_block.RATIO_FIELDS, type(None))
# per-round ms: the medians are fwd 2, official 4, floor 1, f+b 6, official 10, floor 3; the best rounds fwd 1, 3,
# f+b 4, 8
FIXED_MS = {"fwd": [2.0, 1.0, 3.0, 2.0, 2.5, 1.5, 9.0], "official_fwd": [4.0, 3.0, 5.0, 4.0, 4.5, 3.5, 9.0],
            "fb": [6.0, 4.0, 9.0, 6.0, 7.0, 5.0, 20.0], "official_fb": [12.0, 8.0, 10.0, 10.0, 11.0, 9.0, 30.0],
            "floor_fwd": [1.0] * 7, "floor_fb": [3.0, 2.0, 4.0, 3.0, 3.0, 3.0, 5.0]}


@pytest.fixture
def fixed_times(monkeypatch):
    """interleaved_ms runs every callable (one round) and returns FIXED_MS; calls records what it was asked."""
    calls = []

    def timed(fns, grad_to_none, rounds, warmup, rep):
        calls.append((list(fns), rounds))
        common.interleaved_ms(fns, grad_to_none, 1, warmup, rep)
        return {name: FIXED_MS[name] for name in fns}

    monkeypatch.setattr(moe_block, "interleaved_ms", timed)
    return calls


def unit(shape) -> float:
    T, d, n, E, K = shape
    return T * K * n * d / 1e9


def test_block_bench_cpu_record(tmp_path, fixed_times):
    out = tmp_path / "moe_block.json"
    moe_block.main(["--device", "cpu", "--shape", "64,32,16,4,2", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload["mode"] == "block" and payload["official_unavailable"] == "--device cpu"
    # at least 7 rounds by default; the batched-GEMM floor timed in the same rounds
    assert payload["rounds"] == 7 and fixed_times == [(["fwd", "floor_fwd", "fb", "floor_fb"], 7)]
    [rec] = payload["records"]
    assert "error" not in rec, rec.get("trace")
    for field, kind in REQUIRED.items():
        assert isinstance(rec[field], kind), (field, rec[field])
    assert (rec["gpu"], rec["config"], rec["backend"]) == ("cpu", "64,32,16,4,2", "reference")
    u = unit((64, 32, 16, 4, 2))
    assert (rec["fwd_ms"], rec["fb_ms"], rec["bwd_ms"]) == (2.0, 6.0, 4.0)  # medians; bwd = f+b - fwd
    assert rec["fwd_tflops"] == pytest.approx(6 * u / 2) and rec["fb_tflops"] == pytest.approx(18 * u / 6)
    assert rec["bwd_tflops"] == pytest.approx(12 * u / 4) and rec["compile_s"] > 0
    # the block is checked against itself on the reference backend: the same routing, so exact
    assert rec["check_ok"] and rec["max_err"] == 0 and set(rec["check"]) == {"out", "dx", "dw1", "dw2", "drouter"}
    assert rec["rounds_ms"] == {k: FIXED_MS[k] for k in ("fwd", "floor_fwd", "fb", "floor_fb")}
    assert (rec["floor_fwd_ms"], rec["floor_fb_ms"]) == (1.0, 3.0)  # medians
    assert (rec["of_floor_fwd"], rec["of_floor_fb"]) == (1 / 2, 3 / 6)  # the floor's ms over ours
    assert rec["bound_fwd"] is None and rec["bound_fb"] is None  # no official layer to bound
    assert "64,32,16,4,2" not in moe_configs.CONFIGS  # an extra shape is the run's, not the module's
    assert 1 <= rec["load_max_over_mean"] <= 4 / 2  # between balanced and E / K


def test_block_load_is_the_busiest_experts_rows_over_the_mean(monkeypatch):
    """load_max_over_mean reads the block's own routed counts: a router forced to send every token to expert 0
    and 1 (of 4, K 2) reads E / K."""
    shape = (64, 32, 16, 4, 2)
    p = moe_layer.Problem(*shape, device="cpu")
    moe = moe_block.sonic_block(p, moe_block.block_moe_config("sonic_7b", shape, "reference"))
    assert moe_block.load_max_over_mean(moe, p.x, False, 4096) < 2
    with torch.no_grad():
        moe.router.weight_ED.zero_()
        moe.router.expert_bias_E.copy_(torch.tensor([2.0, 1.0, 0.0, 0.0]))
    assert moe_block.load_max_over_mean(moe, p.x, False, 4096) == 2


def test_rounds_must_be_positive():
    with pytest.raises(SystemExit):
        moe_block.main(["--device", "cpu", "--shape", "64,32,16,4,2", "--rounds", "0"])


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


@pytest.mark.parametrize("model", ["tiny", "sonic_7b"])
def test_block_bench_official_fields_with_a_stand_in(fixed_times, model):
    """The official path (built on the same weights, timed interleaved, compared) without a GPU."""
    official = (_StandInOfficial, types.SimpleNamespace(SWIGLU="swiglu"))
    args = argparse.Namespace(device="cpu", model=model, rounds=7, warmup=1, rep=1, seq_len=16)
    records = []
    moe_block.run_block_config("tiny", (48, 32, 16, 4, 2), ["reference"], official, args, set(), records.append)
    [rec] = records
    assert "error" not in rec, rec.get("trace")
    # interleaved within each round
    assert fixed_times == [(["fwd", "official_fwd", "floor_fwd", "fb", "official_fb", "floor_fb"], 7)]
    assert rec["official_compile_s"] > 0 and rec["official_held_mib"] is None
    assert rec["official_fb_tflops"] == pytest.approx(18 * unit((48, 32, 16, 4, 2)) / 10)
    # Sonic over official, official ms / ours: medians, then each side's best round; bwd = f+b - fwd
    assert rec["ratio_fwd"] == 4 / 2 and rec["ratio_fb"] == 10 / 6 and rec["ratio_bwd"] == (10 - 4) / (6 - 2)
    assert rec["best_ratio_fwd"] == 3 / 1 and rec["best_ratio_fb"] == 8 / 4
    assert rec["best_ratio_bwd"] == (8 - 3) / (4 - 1)
    assert rec["ratio_fb"] == pytest.approx(rec["fb_tflops"] / rec["official_fb_tflops"])
    assert rec["bound_fwd"] == 4 / 1 and rec["bound_fb"] == 10 / 3  # the official layer's ms over the floor's
    if model == "tiny":
        assert rec["official_err_out"] < 1e-2  # same weights, same top-K + softmax routing
    else:  # sonic_7b centres the router's input: other picks, so no output comparison
        assert rec["official_err_out"] is None
    summary = moe_block.block_summary(records)
    assert "1.67 (2.00)" in summary and "2.00 (3.00)" in summary and "1.50 (1.67)" in summary


@pytest.mark.parametrize("phase, tknd", [("floor_fwd", 6), ("floor_fb", 18)])
def test_batched_floor_does_the_papers_flops(phase, tknd):
    """The floor's products are the experts' at even routing: 6 TKnd forward, 18 TKnd forward and backward, the FLOPs
    the TFLOPS columns divide by (so its ms and the block's are for the same work)."""
    from torch.utils.flop_counter import FlopCounterMode

    T, d, n, E, K = shape = (64, 32, 16, 4, 2)
    floor = moe_block.batched_floor(moe_layer.Problem(*shape, device="cpu"))
    with FlopCounterMode(display=False) as counter:
        floor[phase]()
    assert counter.get_total_flops() == tknd * T * K * n * d


def test_batched_floor_needs_whole_rows_per_expert():
    assert moe_block.batched_floor(moe_layer.Problem(30, 32, 16, 8, 2, device="cpu")) is None  # 60 rows over 8


def test_ratios_are_none_where_a_backward_is_not_positive():
    times = {"fwd": [2.0], "fb": [1.5], "official_fwd": [1.0], "official_fb": [3.0]}  # noise: ours fb < fwd
    got = moe_block.ratios(times)
    assert got["ratio_bwd"] is None and got["best_ratio_bwd"] is None
    assert got["ratio_fwd"] == 0.5 and got["ratio_fb"] == 2.0
    assert set(got) == set(moe_block.RATIO_FIELDS)


def test_moe_layer_block_points_to_the_block_module(capsys):
    with pytest.raises(SystemExit):
        moe_layer.main(["--block", "--device", "cpu", "--shape", "64,32,16,4,2"])
    assert "python -m bench.moe_block" in capsys.readouterr().err


def test_block_bench_times_the_compiled_block_too(tmp_path, fixed_times):
    """--compile adds each backend's block under torch.compile (as the trainer runs it), checked like the rest."""
    out = tmp_path / "moe_block.json"
    moe_block.main(["--device", "cpu", "--shape", "64,32,16,4,2", "--rounds", "1", "--compile", "--json", str(out)])
    records = {r["backend"]: r for r in json.loads(out.read_text())["records"]}
    assert set(records) == {"reference", "reference+compile"}
    compiled = records["reference+compile"]
    assert "error" not in compiled, compiled.get("trace")
    assert compiled["check_ok"] and compiled["max_err"] < 1e-2, compiled["check"]  # bf16: inductor rounds its own way


def test_block_bench_compile_only_times_just_the_compiled_block(tmp_path, fixed_times):
    """--compile only: the block as the trainer runs it, without the eager one (which is host-bound on a GPU)."""
    out = tmp_path / "moe_block.json"
    moe_block.main(["--device", "cpu", "--shape", "64,32,16,4,2", "--rounds", "1", "--compile", "only",
                    "--json", str(out)])
    assert [r["backend"] for r in json.loads(out.read_text())["records"]] == ["reference+compile"]
