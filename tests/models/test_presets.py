import pytest
import torch

from sonic.models import Transformer, param_counts
from tests.helpers import compose_config

# (total, active) parameters, published where available: OLMoE-1B-7B 6.92B / 1.28B,
# Qwen3-30B-A3B 30.5B / 3.3B; the paper's TR study models 0.5B / 1.4B / 1.8B.
EXPECTED = {
    "olmoe_1b_7b": (6_919_161_856, 1_282_017_280),
    "qwen3_30b_a3b": (30_532_122_624, 3_353_032_704),
    "sonic_7b": (6_768_281_088, 1_105_970_688),
    "tr_0p5b": (520_557_312, 124_195_584),
    "tr_1p4b": (1_441_880_832, 167_860_992),
    "tr_1p8b": (1_881_281_280, 125_965_056),
}


def tiny_by_hand() -> tuple[int, int]:
    D, L, V, E, K, N = 128, 4, 384, 8, 2, 128
    attn = 4 * D * D + 2 * D  # q, k, v, o + full-width q/k norms
    per_layer_shared = attn + 2 * D + E * D  # + block norms + router
    experts = 3 * D * N
    total = L * (per_layer_shared + E * experts) + V * D + D  # tied head, final norm
    active = L * (per_layer_shared + K * experts) + V * D + D
    return total, active


@pytest.mark.parametrize("name", ["tiny", *EXPECTED])
def test_preset_composes_and_counts_match(name):
    cfg = compose_config(f"model={name}")
    assert cfg.model.name == name
    with torch.device("meta"):
        model = Transformer(cfg.model)
    counts = param_counts(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == counts.total
    expected = tiny_by_hand() if name == "tiny" else EXPECTED[name]
    assert (counts.total, counts.active) == expected


def test_olmoe_matches_published_rounding():
    counts = param_counts(compose_config("model=olmoe_1b_7b").model)
    assert round(counts.total / 1e9, 2) == 6.92 and round(counts.active / 1e9, 2) == 1.28


def test_unknown_preset_is_a_clear_error():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="nope"):
        compose_config("model=nope")


@pytest.mark.parametrize("override, field", [
    ("model.dim=130", "num_heads"),
    ("model.moe.top_k=9", "top_k"),
    ("model.num_kv_heads=3", "num_kv_heads"),
    ("model.qk_norm=bogus", "qk_norm"),
    ("model.first_k_dense=2", "dense_dim"),
    ("train.seq_len=1024", "max_seq_len"),
])
def test_impossible_shapes_name_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        compose_config(override)


def test_unknown_key_fails_at_composition():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="not_a_field"):
        compose_config("model.not_a_field=1")


def test_presets_module_matches_hydra_composition():
    from sonic.models.presets import load_preset, preset_names

    assert set(EXPECTED) | {"tiny"} == set(preset_names())
    for name in preset_names():
        assert load_preset(name) == compose_config(f"model={name}").model
    with pytest.raises(ValueError, match="unknown model preset"):
        load_preset("nope")


@pytest.mark.parametrize("name, ffn_out_init, embed_scale", [
    ("sonic_7b", "unscaled", 8.0),  # both: issue #30's runs (docs/routing.md, "The fix on the GPU")
    ("tr_0p5b", "unscaled", 1.0), ("tr_1p4b", "unscaled", 1.0), ("tr_1p8b", "unscaled", 1.0),  # x8: the head copies
    ("olmoe_1b_7b", "scaled", 1.0), ("qwen3_30b_a3b", "scaled", 1.0), ("tiny", "scaled", 1.0),
])
def test_from_scratch_presets_grow_the_bottom_of_the_residual_stream(name, ffn_out_init, embed_scale):
    """Issue #30's fix is in the presets: with GPT-2's scaled FFN init and the embedding x1, sonic_7b's layer-0
    gradient spikes and the load collapse at peak LR come back; the embedding x8 lowers its loss further."""
    model = compose_config(f"model={name}").model
    assert (model.ffn_out_init, model.embed_scale) == (ffn_out_init, embed_scale)
