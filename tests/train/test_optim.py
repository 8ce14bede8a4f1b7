import math

import pytest
import torch

from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.train.optim import OptimConfig, apply_config, build_optimizer, lr_factor, set_lr


def test_cosine_warmup_then_decay_to_min():
    cfg = OptimConfig(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, 100, cfg) == pytest.approx(0.1)
    assert lr_factor(9, 100, cfg) == pytest.approx(1.0)
    assert lr_factor(10, 100, cfg) == pytest.approx(1.0)
    assert lr_factor(55, 100, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(100, 100, cfg) == pytest.approx(0.1)


def test_wsd_is_flat_then_linear():
    cfg = OptimConfig(schedule="wsd", warmup_steps=5, decay_fraction=0.2, min_lr_ratio=0.0)
    assert [lr_factor(s, 100, cfg) for s in (5, 50, 79)] == [1.0, 1.0, 1.0]
    assert lr_factor(80, 100, cfg) == pytest.approx(1.0)
    assert lr_factor(90, 100, cfg) == pytest.approx(0.5)
    assert lr_factor(100, 100, cfg) == pytest.approx(0.0)


def test_no_decay_on_norms_biases_embeddings():
    model = Transformer(ModelConfig(vocab_size=32, dim=16, num_layers=1, num_heads=2, qk_norm="full",
                                    moe=MoEConfig(num_experts=2, top_k=1, expert_dim=8, expert_bias=True)))
    decay, no_decay = build_optimizer(model, OptimConfig(weight_decay=0.1)).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert "embed_tokens.weight" in no_decay_names and "norm.weight" in no_decay_names
    assert "layers.0.ffn.b1_EF" in no_decay_names
    assert "layers.0.ffn.w1_EFD" not in no_decay_names
    all_decay = build_optimizer(model, OptimConfig(decay_norms_and_embeddings=True)).param_groups
    assert len(all_decay[1]["params"]) == 0


@pytest.mark.parametrize("kw, field", [({"schedule": "linear"}, "schedule"), ({"lr": 0.0}, "lr"),
                                       ({"beta2": 1.0}, "beta2"), ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
                                       ({"implementation": "apex"}, "implementation")])
def test_bad_optim_config(kw, field):
    with pytest.raises(ValueError, match=field):
        OptimConfig(**kw)


def test_decoupled_weight_decay_shrinks_weights_without_gradient():
    p = torch.nn.Parameter(torch.ones(4, 4))
    opt = torch.optim.AdamW([{"params": [p], "weight_decay": 0.5}], lr=0.1)
    p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((4, 4), 1 - 0.1 * 0.5))


def test_the_three_adamw_implementations_take_the_same_step():
    """optim.implementation picks torch's code path only: the updates agree to rounding."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, dim=16, num_layers=1, num_heads=2, moe=MoEConfig(num_experts=4, top_k=2, expert_dim=8))
    base = Transformer(cfg)
    base.init_weights(seed=0)
    tokens = torch.randint(0, 32, (2, 8))
    after = {}
    for impl in ("fused", "foreach", "for_loop"):
        model = Transformer(cfg)
        model.load_state_dict(base.state_dict())
        opt = build_optimizer(model, OptimConfig(implementation=impl))
        assert opt.defaults["fused" if impl == "fused" else "foreach"] is (impl != "for_loop")
        for _ in range(2):
            out = model(tokens)
            (out.logits_BSV.square().mean() + out.router_loss).backward()
            opt.step()
            opt.zero_grad()
        after[impl] = torch.cat([p.detach().flatten() for p in model.parameters()])
    moved = (after["fused"] - torch.cat([p.detach().flatten() for p in base.parameters()])).abs().max()
    assert moved > 1e-4  # the steps did something
    for impl in ("foreach", "for_loop"):
        torch.testing.assert_close(after[impl], after["fused"], rtol=1e-5, atol=1e-6)


def test_the_config_sets_every_hyperparameter_after_a_resume():
    """Loading an optimizer's state also loads the checkpoint's hyperparameters; the trainer sets
    them from the run's config again, and the LR from (config, step) at every step."""
    model = Transformer(ModelConfig(vocab_size=32, dim=16, num_layers=1, num_heads=2,
                                    moe=MoEConfig(num_experts=2, top_k=1, expert_dim=8)))
    saved = build_optimizer(model, OptimConfig(lr=1e6, weight_decay=0.3, beta1=0.5, eps=1e-3, implementation="fused"))
    cfg = OptimConfig(lr=1e-4, weight_decay=0.05, beta2=0.99, schedule="constant", warmup_steps=10,
                      implementation="foreach")
    optimizer = build_optimizer(model, cfg)
    optimizer.load_state_dict(saved.state_dict())
    assert optimizer.param_groups[0]["lr"] == 1e6 and optimizer.param_groups[0]["weight_decay"] == 0.3
    apply_config(optimizer, cfg)
    assert set_lr(optimizer, cfg, step=4, total_steps=100) == pytest.approx(0.5e-4)  # warmup: (4 + 1) / 10
    decay, no_decay = optimizer.param_groups
    for group, weight_decay in ((decay, 0.05), (no_decay, 0.0)):
        assert group["lr"] == pytest.approx(0.5e-4) and group["weight_decay"] == weight_decay
        assert group["betas"] == (0.9, 0.99) and group["eps"] == 1e-8
        assert group["foreach"] and not group["fused"]
