"""Initialisation: the zero attention output keeps a deep model's routers healthy at step 0.

The failure it guards against (docs/routing.md): with GPT-2 init, attention adds nearly the same
vector to every position in every layer, so deep routers see parallel inputs and send every token
to the same experts. A narrow model shows it when init_std^2 * dim matches sonic_7b's (0.02^2 * 1536).
"""
import pytest
import torch

from sonic.models import ModelConfig, MoEConfig, Transformer


def deep_narrow(attn_out_init: str, layers: int = 12) -> Transformer:
    cfg = ModelConfig(vocab_size=512, dim=128, num_layers=layers, num_heads=4, max_seq_len=256, qk_norm="full",
                      tie_embeddings=True, init_std=0.07, attn_out_init=attn_out_init,
                      moe=MoEConfig(num_experts=16, top_k=2, expert_dim=32, shared_expert_dim=64))
    model = Transformer(cfg)
    model.init_weights(seed=0)
    return model.eval()


def worst_max_over_mean(model: Transformer) -> float:
    ids = torch.randint(0, 512, (4, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids)
    return max((r.counts_E.max() / r.counts_E.float().mean()).item() for r in out.routed)


def test_zero_attention_output_keeps_deep_routers_balanced():
    assert worst_max_over_mean(deep_narrow("zero")) < 2.5
    assert worst_max_over_mean(deep_narrow("scaled")) > 2.8  # the test can tell the two apart


def test_zero_attention_output_changes_nothing_else():
    zero, scaled = deep_narrow("zero", layers=2), deep_narrow("scaled", layers=2)
    for (name, p), q in zip(zero.named_parameters(), scaled.parameters()):
        if name.endswith("o_proj.weight"):
            assert not p.any() and q.std() > 0
        else:
            assert torch.equal(p, q), name


def test_bad_attn_out_init_is_a_clear_error():
    with pytest.raises(ValueError, match="attn_out_init"):
        ModelConfig(attn_out_init="xavier")


def test_unscaled_ffn_out_init_draws_the_down_projections_at_init_std_and_changes_nothing_else():
    scaled, unscaled = deep_narrow("zero", layers=2), deep_narrow("zero", layers=2)
    unscaled.cfg.ffn_out_init = "unscaled"
    unscaled.init_weights(seed=0)
    for (name, p), q in zip(scaled.named_parameters(), unscaled.parameters()):
        if name.endswith(("down_proj.weight", "w2_EDN")):  # the same draw, times sqrt(2L) = 2
            torch.testing.assert_close(q, p * 2, rtol=1e-6, atol=0)
        else:
            assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="ffn_out_init"):
        ModelConfig(ffn_out_init="olmo")


def test_embed_scale_multiplies_the_first_blocks_input_and_not_the_tied_head():
    model = deep_narrow("zero", layers=1)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    seen = []
    model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        model(ids)
        model.cfg.embed_scale = 4.0
        model(ids)
    torch.testing.assert_close(seen[1], seen[0] * 4, rtol=0, atol=0)
    torch.testing.assert_close(seen[0], model.embed_tokens(ids), rtol=0, atol=0)
    with pytest.raises(ValueError, match="embed_scale"):
        ModelConfig(embed_scale=0.0)
