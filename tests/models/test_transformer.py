import pytest
import torch
import torch.nn.functional as F

from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.routing import RoutingConfig


def small(**kw) -> ModelConfig:
    moe = kw.pop("moe", {})
    return ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, max_seq_len=32,
                       moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, **moe), **kw)


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.init_weights(seed)
    return model


@pytest.mark.parametrize("kw", [
    {},
    {"qk_norm": "full"},
    {"qk_norm": "head", "num_kv_heads": 2},
    {"num_kv_heads": 1, "head_dim": 16},
    {"tie_embeddings": True},
    {"first_k_dense": 1, "dense_dim": 48},
    {"moe": {"shared_expert_dim": 24, "expert_bias": True}},
])
def test_forward_backward_shapes(kw):
    model = build(small(**kw))
    ids = torch.randint(0, 64, (3, 17))
    out = model(ids)
    assert out.logits_BSV.shape == (3, 17, 64)
    assert len(out.routed) == 2 - kw.get("first_k_dense", 0)
    (out.logits_BSV.square().mean() + out.router_loss).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.layers[-1].ffn.w1_EFD.grad.abs().sum() > 0


def test_tiny_model_overfits_a_fixed_batch():
    model = build(small())
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        out = model(ids[:, :-1])
        loss = F.cross_entropy(out.logits_BSV.flatten(0, 1), ids[:, 1:].flatten())
        (loss + out.router_loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_document_mask_blocks_cross_document_attention():
    model = build(small()).eval()
    ids = torch.randint(0, 64, (1, 12))
    one_doc = torch.zeros(1, 12, dtype=torch.long)
    torch.testing.assert_close(model(ids, one_doc).logits_BSV, model(ids).logits_BSV, atol=1e-5, rtol=1e-5)
    # with two documents, the second one's logits equal running it alone
    two_docs = torch.tensor([[0] * 5 + [1] * 7])
    joint = model(ids, two_docs).logits_BSV[:, 5:]
    alone = model(ids[:, 5:]).logits_BSV
    torch.testing.assert_close(joint, alone, atol=1e-5, rtol=1e-5)


def test_backends_agree_inside_the_model():
    cfg = small()
    ids = torch.randint(0, 64, (2, 9))
    ref = build(cfg)(ids).logits_BSV
    cfg.moe.kernel_backend = "naive"
    torch.testing.assert_close(build(cfg)(ids).logits_BSV, ref, atol=1e-5, rtol=1e-5)


def test_unavailable_backend_is_a_clear_error():
    cfg = small(moe={"kernel_backend": "cute"})
    model = build(cfg)
    with pytest.raises(ValueError, match="cute"):
        model(torch.randint(0, 64, (1, 4)))


def test_sequence_longer_than_max_is_a_clear_error():
    with pytest.raises(ValueError, match="max_seq_len"):
        build(small())(torch.randint(0, 64, (1, 40)))


def test_routing_config_nested_in_model():
    cfg = small(moe={"routing": RoutingConfig(aux_loss_coef=0.0, z_loss_coef=0.0)})
    out = build(cfg)(torch.randint(0, 64, (2, 8)))
    assert out.router_loss.item() == 0.0
