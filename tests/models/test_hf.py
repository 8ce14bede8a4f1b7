"""HF interop: tiny random OLMoE / Qwen3-MoE models built from transformers config classes (no downloads)."""
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import OlmoeConfig, OlmoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from sonic.data.tokenizer import ByteTokenizer  # noqa: E402
from sonic.models import ModelConfig, MoEConfig, Transformer  # noqa: E402
from sonic.models.hf import (check_init_config, export_hf, from_hf_config, hf_config_mismatches, import_hf,  # noqa: E402
                             read_safetensors_dir, to_hf_config)
from sonic.models.loading import load_model  # noqa: E402
from sonic.routing import RoutingConfig  # noqa: E402

V = 96


def olmoe(**kw):
    return OlmoeForCausalLM, OlmoeConfig(**{**dict(
        vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, max_position_embeddings=64, rope_theta=5000.0,
        rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1), **kw})


def qwen3(**kw):
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(**{**dict(
        vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=64, tie_word_embeddings=True,
        rope_theta=1e6), **kw})


def random_hf(cls, config, seed=0):
    """Weights large enough that outputs, norms and routing are far from trivial (std-0.02 init is nearly 0)."""
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else
                    torch.randn_like(p) if name.endswith("mlp.gate.weight") else 0.15 * torch.randn_like(p))
    return model


def sonic_logits(model: Transformer, ids):
    with torch.no_grad():
        return model.eval()(ids).logits_BSV


def hf_logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits


CASES = {
    "olmoe": olmoe(),
    "olmoe_renorm_tied": olmoe(norm_topk_prob=True, tie_word_embeddings=True, num_key_value_heads=4),
    "qwen3": qwen3(),
    "qwen3_no_renorm_untied": qwen3(norm_topk_prob=False, tie_word_embeddings=False, mlp_only_layers=[]),
}


@pytest.mark.parametrize("case", CASES)
def test_import_matches_transformers_and_exports_back_exactly(case, tmp_path):
    cls, config = CASES[case]
    hf = random_hf(cls, config)
    hf.save_pretrained(tmp_path / "hf")
    cfg, state = import_hf(tmp_path / "hf")
    cfg.moe.kernel_backend = "reference"
    assert cfg.moe.routing.order == "softmax_topk" and cfg.moe.routing.renormalize == config.norm_topk_prob
    model = Transformer(cfg)
    model.load_state_dict(state, strict=True)
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(hf, ids)
    assert expected.std() > 0.1  # a real signal, not ~0 outputs
    assert (sonic_logits(model, ids) - expected).abs().max() <= 1e-4

    export_hf(model, cfg, tmp_path / "back")
    original, back = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for name, t in original.items():
        assert torch.equal(t, back[name]), name
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert from_hf_config(reloaded) == from_hf_config(config)


SONIC_CASES = {
    "tiny_olmoe_like": dict(qk_norm="full", tie_embeddings=True),  # topk_softmax == norm_topk_prob
    "olmoe_softmax_topk": dict(qk_norm="full", num_kv_heads=2,
                               moe=dict(routing=RoutingConfig(order="softmax_topk", renormalize=False))),
    "qwen3_gqa_head_dim_dense": dict(qk_norm="head", num_kv_heads=1, head_dim=24, first_k_dense=1, dense_dim=40,
                                     moe=dict(routing=RoutingConfig(order="softmax_topk", renormalize=True))),
    "token_rounding_exports_as_topk": dict(qk_norm="head", moe=dict(routing=RoutingConfig(method="token_rounding"))),
}


def sonic_config(**kw) -> ModelConfig:
    moe = kw.pop("moe", {})
    return ModelConfig(vocab_size=V, dim=32, num_layers=3, num_heads=4, max_seq_len=48, rope_theta=20000.0,
                       norm_eps=1e-5, moe=MoEConfig(num_experts=5, top_k=2, expert_dim=16,
                                                    kernel_backend="reference", **moe), **kw)


def random_sonic(cfg: ModelConfig, seed=0) -> Transformer:
    model = Transformer(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else noise if "router" in name else 0.15 * noise)
    return model


@pytest.mark.parametrize("case", SONIC_CASES)
def test_export_loads_in_transformers_with_the_same_logits(case, tmp_path):
    cfg = sonic_config(**SONIC_CASES[case])
    model = random_sonic(cfg)
    out = export_hf(model, cfg, tmp_path / "hf", tokenizer=ByteTokenizer())
    cls = OlmoeForCausalLM if cfg.qk_norm == "full" else Qwen3MoeForCausalLM
    hf, info = cls.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched weights
    ids = torch.randint(3, V, (2, 30), generator=torch.Generator().manual_seed(2))
    assert (hf_logits(hf, ids) - sonic_logits(model, ids)).abs().max() <= 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "Kit is a red fox."
    assert tok.encode(text) == ByteTokenizer().encode(text)  # the default call adds nothing (ByT5's appended </s>)
    assert hf.config.eos_token_id == hf.config.bos_token_id == ByteTokenizer.eos_token_id


def test_load_model_reads_a_hugging_face_directory(tmp_path):
    cls, config = CASES["qwen3"]
    hf = random_hf(cls, config)
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", kernel_backend="reference")
    assert loaded.config.qk_norm == "head" and loaded.config.first_k_dense == 1
    assert loaded.tokenizer is None  # no tokenizer files were saved
    ids = torch.randint(0, V, (1, 16))
    assert (sonic_logits(loaded.model, ids) - hf_logits(hf, ids)).abs().max() <= 1e-4


@pytest.mark.parametrize("kw, field", [
    (dict(qk_norm="none"), "qk_norm"),
    (dict(qk_norm="full", moe=dict(expert_bias=True)), "expert_bias"),
    (dict(qk_norm="head", moe=dict(shared_expert_dim=8)), "shared_expert_dim"),
    (dict(qk_norm="head", moe=dict(routing=RoutingConfig(method="expert_choice"))), "expert_choice"),
    (dict(qk_norm="full", moe=dict(routing=RoutingConfig(input_centring="prefix"))), "input_centring"),
    (dict(qk_norm="full", moe=dict(routing=RoutingConfig(balance="sinkhorn"))), "balance"),
    (dict(qk_norm="full", moe=dict(routing=RoutingConfig(logit_norm="prefix"))), "logit_norm"),
    (dict(qk_norm="full", first_k_dense=1, dense_dim=8), "first_k_dense"),
    (dict(qk_norm="full", embed_scale=8.0), "embed_scale"),
    (dict(qk_norm="full", head_dim=16), "head_dim"),
])
def test_export_refuses_what_hf_cannot_represent(kw, field, tmp_path):
    cfg = sonic_config(**kw)
    with pytest.raises(ValueError, match=field):
        export_hf(Transformer(cfg), cfg, tmp_path)


def test_export_refuses_a_nonzero_expert_selection_bias(tmp_path):
    cfg = sonic_config(qk_norm="full")
    model = random_sonic(cfg)
    model.layers[1].ffn.router.expert_bias_E[2] = 0.5
    with pytest.raises(ValueError, match="layers.1.ffn.router.expert_bias_E"):
        export_hf(model, cfg, tmp_path)


@pytest.mark.parametrize("make, field", [
    (lambda: olmoe(clip_qkv=8.0), "clip_qkv"),
    (lambda: olmoe(hidden_act="gelu"), "hidden_act"),
    (lambda: olmoe(attention_bias=True), "attention_bias"),
    (lambda: qwen3(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}), "rope_parameters"),
    (lambda: qwen3(use_sliding_window=True), "use_sliding_window"),
    (lambda: qwen3(mlp_only_layers=[1]), "mlp_only_layers"),
])
def test_import_refuses_unsupported_hf_configs(make, field):
    with pytest.raises(ValueError, match=field):
        from_hf_config(make()[1])


def test_hf_config_round_trips_through_sonic():
    for case in ("olmoe", "qwen3"):
        cfg = from_hf_config(CASES[case][1])
        assert from_hf_config(to_hf_config(cfg)) == cfg


@pytest.mark.parametrize("case", ["olmoe", "qwen3"])
def test_init_from_config_check_lists_every_field_that_changes_the_computation(case, tmp_path):
    cls, config = CASES[case]
    random_hf(cls, config).save_pretrained(tmp_path / "hf")
    cfg = from_hf_config(config)
    assert hf_config_mismatches(tmp_path / "hf", cfg) == []
    check_init_config(tmp_path / "hf", cfg)  # the matching model.* passes
    routing = cfg.moe.routing
    wrong = dataclasses.replace(cfg, rope_theta=cfg.rope_theta * 2, norm_eps=cfg.norm_eps * 10, moe=dataclasses.replace(
        cfg.moe, top_k=cfg.moe.top_k - 1,
        routing=dataclasses.replace(routing, renormalize=not routing.renormalize)))  # token_rounding's switch
    found = hf_config_mismatches(tmp_path / "hf", wrong)
    assert [m.split("=")[0] for m in found] == [
        "model.rope_theta", "model.norm_eps", "model.moe.top_k", "model.moe.routing.order/renormalize (K gates "
        "renormalised)"]
    assert f"model.rope_theta={wrong.rope_theta!r} but config.json (rope_theta) gives {cfg.rope_theta!r}" in found
    with pytest.raises(ValueError, match="init_from_strict=false") as err:
        check_init_config(tmp_path / "hf", wrong)
    assert all(m in str(err.value) for m in found)


def test_init_from_config_check_only_warns_when_not_strict(tmp_path, caplog):
    cls, config = CASES["olmoe"]
    random_hf(cls, config).save_pretrained(tmp_path / "hf")
    wrong = dataclasses.replace(from_hf_config(config), rope_theta=123.0)
    with caplog.at_level("WARNING", logger="sonic"):
        check_init_config(tmp_path / "hf", wrong, strict=False)
    assert "model.rope_theta=123.0 but config.json (rope_theta) gives 5000.0" in caplog.text
    assert hf_config_mismatches(tmp_path / "missing", wrong) == []  # not an HF directory: nothing to compare


def test_exported_tokenizers_encode_text_as_sonic_does(tmp_path):
    """Whatever the run's tokenizer adds by default (here a <s> ... </s> template), the export's plain
    encode(text) gives Sonic's ids: nothing added, literal special-token text split, EOS as its BOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from sonic.data.tokenizer import HFTokenizer

    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(sorted(set("Kit is a red fox.</s>")))}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    text = "Kit is a red fox. </s>"
    assert wrapped.encode(text)[0] == 0 and wrapped.encode(text)[-1] == 1  # the template adds <s> and </s>
    for name, sonic in (("byte", ByteTokenizer()), ("template", HFTokenizer("template", wrapped))):
        export_hf(Transformer(sonic_config(qk_norm="full")), sonic_config(qk_norm="full"), tmp_path / name,
                  tokenizer=sonic)
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path / name)
        assert tok.encode(text) == sonic.encode(text) == tok(text)["input_ids"], name
        assert tok.bos_token_id == tok.eos_token_id == sonic.eos_token_id, name
    assert wrapped.encode(text)[0] == 0  # the run's own tokenizer is left as it was
