"""bench.routing_health on CPU with a tiny config: the real trainer's per-step, per-layer load curve
and the router diagnostics reach the JSON, the diagnostics see each step's weights and expert bias,
and they leave training unchanged."""
import json
import math

import pytest

from bench import routing_health

LAYERS, STEPS = 3, 6
TINY = [f"model.num_layers={LAYERS}", "model.moe.routing.bias_update_rate=0.01",
        "model.moe.routing.input_centring=prefix",
        f"train.steps={STEPS}", "train.log_every=2", "train.grad_accum=2", "train.micro_batch_size=2",
        "train.seq_len=32", "data=embedded"]


def run(tmp_path, name, *args):
    path = tmp_path / f"{name}.json"
    routing_health.main(["--json", str(path), "--run-dir", str(tmp_path / name), *args, *TINY])
    return json.loads(path.read_text())


def test_routing_health_bench_writes_the_curve_and_the_diagnostics(tmp_path):
    result = run(tmp_path, "diag", "--diag-every", "2")
    assert [s["step"] for s in result["steps"]] == [2, 4, 6]
    for s in result["steps"]:
        assert len(s["max_over_mean"]) == LAYERS and all(1 <= v <= 8 / 2 for v in s["max_over_mean"])
        assert s["lr"] > 0 and math.isfinite(s["loss"])
    assert [d["step"] for d in result["diagnostics"]] == [1, 2, 3, 4, 5, 6]
    for d in result["diagnostics"]:
        assert [row["layer"] for row in d["layers"]] == list(range(LAYERS))
        for row in d["layers"]:
            assert set(routing_health.DIAG_FIELDS) <= set(row)
            assert 0 <= row["mean_share"] <= 1 and -1 <= row["cos_to_mean"] <= 1
            assert 1 <= row["max_over_mean"] <= 8 / 2 and row["logit_token_std"] > 0
            assert 1 <= row["seq_max_over_mean"] <= 8 / 2 and row["logit_seq_common_std"] >= 0
            assert all(0 <= row[k] <= 1 for k in ("hot_common_rank", "hot_std_rank", "hot_bias_rank",
                                                    "u_mean_share", "u_seq_mean_share", "hot_top1_id_share",
                                                    "top10_id_share", "u_mean_share_head", "u_mean_share_tail",
                                                    "ema64_mean_share", "ema512_mean_share", "c_along_mean_share",
                                                    "c_mean_share"))
            assert row["hot_top1_id_share"] <= row["hot_top10_id_share"] <= 1
            assert row["logit_expert_std_cv"] > 0 and row["router_row_norm_cv"] > 0
    first, later = result["diagnostics"][0]["layers"], result["diagnostics"][-1]["layers"]
    assert all(row["bias_range"] == 0 for row in first)  # step 1 routes with the initial (zero) expert bias
    assert all(row["bias_range"] > 0 for row in later)  # step 6 with the bias of 5 updates
    assert math.isnan(first[0]["cos_mean_to_prev"]) and all(math.isfinite(r["cos_mean_to_prev"]) for r in first[1:])
    assert all(math.isnan(r["mean_step_change"]) and r["mean_half_gap"] > 0 for r in first)
    assert all(math.isfinite(r["mean_step_change"]) for r in later)
    assert all(math.isnan(r["logit_common_step_cos"]) for r in first)
    assert all(-1 <= r["logit_common_step_cos"] <= 1 for r in later)
    assert any(r["attn_adds_to_mean"] != 0 for r in later)  # attention's o_proj (zero at init) has grown
    summary = result["summary"]
    assert summary["last_step"] == STEPS and summary["E/K"] == 4
    assert summary["worst_max_over_mean_at_last_step"] == max(result["steps"][-1]["max_over_mean"])
    assert summary["loss_at_last_step"] == result["steps"][-1]["loss"]
    assert result["routing"]["input_centring"] == "prefix"

    plain = run(tmp_path, "plain", "--diag-every", "0")  # the extra forward changes nothing in training
    assert plain["diagnostics"] == []
    assert [s["loss"] for s in plain["steps"]] == [s["loss"] for s in result["steps"]]
    assert [s["max_over_mean"] for s in plain["steps"]] == [s["max_over_mean"] for s in result["steps"]]


def test_frozen_attention_output_adds_nothing(tmp_path):
    result = run(tmp_path, "frozen", "--diag-every", "2", "--freeze", "attn.o_proj.weight")
    assert result["frozen"] == ["attn.o_proj.weight"]
    assert all(r["attn_adds_to_mean"] == 0 for d in result["diagnostics"] for r in d["layers"])
    with pytest.raises(ValueError, match="--freeze"):
        run(tmp_path, "typo", "--freeze", "o_projection")


def test_ema_centring_is_the_prefix_mean_at_an_infinite_window_and_a_moving_average_below():
    import torch

    from sonic.routing.scores import EPS, prefix_centre

    x_BSD = torch.randn(2, 40, 3, generator=torch.Generator().manual_seed(0))
    c_TD, ms_T = prefix_centre(x_BSD.reshape(80, 3), 40)
    prefix_BSD = (c_TD * torch.rsqrt(ms_T + EPS)[:, None]).view(2, 40, 3)
    torch.testing.assert_close(routing_health._ema_centred(x_BSD, 1e12), prefix_BSD)
    a, want = 1 - 1 / 4, torch.empty(2, 40, 3, dtype=torch.float64)
    for b in range(2):  # x_t minus the a-weighted mean of x_0..x_{t-1}
        total, weight = torch.zeros(3, dtype=torch.float64), 0.0
        for t in range(40):
            want[b, t] = x_BSD[b, t].double() - (total / weight if weight else 0)
            total, weight = a * total + x_BSD[b, t].double(), a * weight + 1
    want = want.float() * torch.rsqrt(want.float().square().mean(-1, keepdim=True) + EPS)
    torch.testing.assert_close(routing_health._ema_centred(x_BSD, 4), want)


def test_summary_reads_the_issue_targets():
    def step(n, loads):
        return {"step": n, "loss": 7.0 - n / 100, "tokens_per_s_per_gpu": 1000.0 + n,
                **{f"expert_load_max/{i}": v for i, v in enumerate(loads)}}

    history = [step(10, [9.0, 1.0]), step(20, [3.0, 1.0]), step(30, [4.5, 1.5]), step(40, [1.9, 2.1])]
    s = routing_health.summarize(history, diags=[{"step": 20}], num_layers=2, e_over_k=16)
    assert s["worst_max_over_mean_from_step_30"] == 4.5 and not s["no_layer_over_4x_from_step_30"]
    assert s["worst_max_over_mean_before_step_30"] == 9.0
    assert s["loss_mean_from_step_30"] == pytest.approx((6.7 + 6.6) / 2)
    assert s["layers_over_2x_at_last_step"] == 1 and not s["every_layer_le_2x_at_last_step"]
    assert s["loss_at_last_step"] == 6.6
    # throughput: intervals after the first that hold no diagnostic step: (20, 30] and (30, 40]
    assert s["tokens_per_s_per_gpu"] == 1035.0 and s["tokens_per_s_per_gpu_intervals"] == 2
