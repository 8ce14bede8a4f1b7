"""bench.routing_health on CPU with a tiny config: the real trainer's per-step, per-layer load curve
and the router diagnostics reach the JSON, the diagnostics see each step's weights and expert bias,
and they leave training unchanged; --final-batches routes the batches after training's, pooled and per batch."""
import json
import math
from unittest import mock

import pytest
import torch

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


def test_final_batches_route_the_next_batches_of_the_stream_after_training(tmp_path):
    from sonic.data import build_loaders, build_tokenizer
    from sonic.train import trainer

    seen = []  # every micro-batch the trainer and then the final batches feed the model, in order
    model_inputs = trainer.model_inputs

    def spy(batch, cfg, device):
        seen.append(batch["input_ids"].clone())
        return model_inputs(batch, cfg, device)

    with mock.patch.object(trainer, "model_inputs", spy):
        result = run(tmp_path, "final", "--final-batches", "3", "--diag-every", "0")
    final = result["final_batches"]
    E, K, L, N, ACCUM = 8, 2, LAYERS, 3, 2
    assert final["batches"] == N and final["micro_batches_per_batch"] == ACCUM
    assert final["skipped_micro_batches"] == STEPS * ACCUM and final["tokens_per_batch"] == ACCUM * 2 * 32
    # the batches: the stream's micro-batches right after training's 12, none of them one training saw
    assert len(seen) == (STEPS + N) * ACCUM
    cfg = routing_health.compose_config([*routing_health.DEFAULTS, *TINY])
    loader, _ = build_loaders(cfg.data, tokenizer=build_tokenizer(cfg.data), seq_len=cfg.train.seq_len,
                              micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed)
    for got in seen:
        assert torch.equal(got, next(loader)["input_ids"])
    trained, after = seen[: STEPS * ACCUM], seen[STEPS * ACCUM:]
    assert not any(torch.equal(a, t) for a in after for t in trained)
    # the counts: per batch, layer and expert, every token's K rows; pooled = their sum
    counts = final["counts"]
    assert [len(c) for c in counts] == [L] * N and all(len(row) == E for c in counts for row in c)
    assert all(sum(row) == final["tokens_per_batch"] * K for c in counts for row in c)

    def ratio(row):
        return max(row) / (sum(row) / len(row))

    for c, got in zip(counts, final["per_batch_max_over_mean"]):
        assert got == pytest.approx([ratio(row) for row in c], rel=1e-6)
    pooled = [[sum(c[i][e] for c in counts) for e in range(E)] for i in range(L)]
    assert final["pooled_max_over_mean"] == pytest.approx([ratio(row) for row in pooled], rel=1e-6)
    assert final["pooled_max_over_mean"] != pytest.approx(final["per_batch_max_over_mean"][-1], rel=1e-6)
    values = [*final["pooled_max_over_mean"], *final["seq_max_over_mean"],
              *(v for r in final["per_batch_max_over_mean"] for v in r)]
    assert len(final["seq_max_over_mean"]) == L and all(1 <= v <= E / K for v in values)
    assert final["per_batch_worst"] == [max(r) for r in final["per_batch_max_over_mean"]]
    assert final["pooled_worst"] == max(final["pooled_max_over_mean"])
    assert final["layers_over_2x_pooled"] == sum(v > 2 for v in final["pooled_max_over_mean"])
    assert final["layers_over_2x_per_batch"] == [sum(v > 2 for v in r) for r in final["per_batch_max_over_mean"]]
    assert len(final["per_batch_loss"]) == N and all(math.isfinite(v) for v in final["per_batch_loss"])

    plain = run(tmp_path, "no_final", "--diag-every", "0")  # the final batches come after training: it is the same
    assert plain["final_batches"] is None
    assert [s["loss"] for s in plain["steps"]] == [s["loss"] for s in result["steps"]]
    assert [s["max_over_mean"] for s in plain["steps"]] == [s["max_over_mean"] for s in result["steps"]]
    with pytest.raises(ValueError, match="--final-batches"):
        run(tmp_path, "negative", "--final-batches", "-1")


def test_final_batches_route_as_training_and_leave_the_model_as_it_was():
    """Token rounding in balance mode: training's forward rounds the counts (eval would route plain top-K) and
    writes the router's balance buffers; final_batches restores them, and its per-sequence rows sum to counts_E."""
    from sonic.data import build_loaders, build_tokenizer
    from sonic.models import Transformer

    cfg = routing_health.compose_config([*TINY, "model.moe.routing.method=token_rounding",
                                         "model.moe.routing.rounding_mode=balance", "model.moe.routing.tile_size=8",
                                         "model.moe.routing.backend=torch"])
    model = Transformer(cfg.model)
    model.init_weights(0)
    with torch.no_grad():  # a non-zero expert bias, which the selection must read and nothing may move
        for i, router in enumerate(m for m in model.modules() if hasattr(m, "expert_bias_E")):
            router.expert_bias_E.copy_(torch.linspace(-0.5, 0.5, 8) * (i + 1))
            router.balance_pending_E.copy_(torch.arange(8) - 4)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loader, _ = build_loaders(cfg.data, tokenizer=build_tokenizer(cfg.data), seq_len=cfg.train.seq_len,
                              micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed)
    final = routing_health.final_batches(model, loader, cfg, 2)
    assert not model.training and loader.consumed == 2 * 2 and final["skipped_micro_batches"] == 0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    rows = [sum(row) for c in final["counts"] for row in c]
    assert all(r % 8 == 0 for r in rows)  # rounded to the tile: training's routing, not eval's plain top-K
    assert rows != [final["tokens_per_batch"] * 2] * len(rows)


def test_routed_per_sequence_counts_each_sequences_picks():
    from sonic.routing import Router
    from sonic.routing.config import RoutingConfig
    from sonic.routing.losses import picks_per_sequence

    router = Router(16, 8, 2, RoutingConfig(backend="torch"))
    with torch.no_grad():
        router.expert_bias_E.copy_(torch.linspace(-1, 1, 8))
    x = torch.randn(3 * 10, 16, generator=torch.Generator().manual_seed(0))
    routed = router(x, 10)
    got = routing_health.routed_per_sequence(routed, 10)
    picks = (router.logits(x, 10) + router.expert_bias_E).topk(2, dim=-1).indices
    assert torch.equal(got, picks_per_sequence(picks, 10, 8, torch.int64))
    assert torch.equal(got.sum(0), routed.counts_E.long()) and got.shape == (3, 8)
    counts = torch.tensor([[1, 2, 3, 6], [0, 0, 0, 0]])
    assert routing_health._max_over_mean(counts).tolist() == [2.0, 0.0]


def test_grad_norms_record_every_step_by_kind_and_layer(tmp_path):
    """--grad-norms: every step's pre-clip norm (the trainer's own at its log steps), split by parameter kind and by
    layer, the kinds' squares summing to the total's; recording changes nothing in training."""
    result = run(tmp_path, "grads", "--diag-every", "0", "--grad-norms")
    grads = result["grad_norms"]
    assert len(grads["total"]) == STEPS and len(grads["by_layer"]) == LAYERS
    for s in result["steps"]:
        assert grads["total"][s["step"] - 1] == pytest.approx(s["grad_norm"], rel=1e-4)
    for n in range(STEPS):
        assert sum(v[n] ** 2 for v in grads["by_kind"].values()) == pytest.approx(grads["total"][n] ** 2, rel=1e-6)
        assert sum(v[n] ** 2 for v in grads["by_layer"]) < grads["total"][n] ** 2  # the embedding is in no layer
    assert all(v > 0 for v in grads["by_kind"]["layers.*.ffn.router.weight_ED"])
    assert "layers.*.attn.q_proj.weight" in grads["by_kind"]
    plain = run(tmp_path, "plain", "--diag-every", "0")
    assert plain["grad_norms"] is None
    assert [s["loss"] for s in plain["steps"]] == [s["loss"] for s in result["steps"]]
    assert [s["grad_norm"] for s in plain["steps"]] == [s["grad_norm"] for s in result["steps"]]


def test_param_kind_stars_the_layer_and_drops_wrapper_prefixes():
    assert routing_health.param_kind("layers.3._orig_mod.attn.q_proj.weight") == ("layers.*.attn.q_proj.weight", 3)
    assert routing_health.param_kind("layers.12.ffn.w1_EFD") == ("layers.*.ffn.w1_EFD", 12)
    assert routing_health.param_kind("embed_tokens.weight") == ("embed_tokens.weight", None)
