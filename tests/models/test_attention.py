"""Attention cores: FlexAttention and the SDPA reference agree, with and without document masks."""
import pytest
import torch

from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.models.attention import ATTENTION_BACKENDS, FlexCore, SDPACore, build_attention_core

CPU = torch.device("cpu")


def qkv(B=2, H=4, G=2, S=48, Hd=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, S, Hd, generator=g), torch.randn(B, G, S, Hd, generator=g),
            torch.randn(B, G, S, Hd, generator=g))


def doc_ids(B, S, seed=0):
    """Random packed rows: documents of random lengths, ids increasing along each row."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(B, S, generator=g) < 0.15
    starts[:, 0] = True
    return starts.long().cumsum(1) - 1


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_flex_matches_sdpa(documents, gqa):
    q, k, v = qkv(G=2 if gqa else 4, seed=int(documents) + 2 * int(gqa))
    docs = doc_ids(2, q.shape[2]) if documents else None
    sdpa, flex = SDPACore(), FlexCore()
    want = sdpa(q, k, v, sdpa.mask(docs, q.shape[2], CPU))
    got = flex(q, k, v, flex.mask(docs, q.shape[2], CPU))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_document_mask_really_blocks():
    """Changing a value in document 0 leaves the outputs of document 1 unchanged (both cores)."""
    q, k, v = qkv(B=1)
    docs = torch.tensor([[0] * 20 + [1] * 28])
    for core in (SDPACore(), FlexCore()):
        mask = core.mask(docs, 48, CPU)
        base = core(q, k, v, mask)
        v2 = v.clone()
        v2[:, :, 3] += 10.0
        moved = core(q, k, v2, mask)
        torch.testing.assert_close(moved[:, :, 20:], base[:, :, 20:])
        assert not torch.allclose(moved[:, :, 3:20], base[:, :, 3:20])


@pytest.mark.parametrize("backend", ["flex", "auto"])
def test_backends_agree_inside_the_model(backend):
    cfg = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32,
               moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16))
    ids, docs = torch.randint(0, 64, (2, 24)), doc_ids(2, 24, seed=3)
    models = {}
    for name in ("sdpa", backend):
        torch.manual_seed(0)
        models[name] = Transformer(ModelConfig(attention_backend=name, **cfg))
        models[name].init_weights(0)
        models[name].eval()
    with torch.no_grad():  # FlexAttention has no CPU backward
        for d in (None, docs):
            torch.testing.assert_close(models[backend](ids, d).logits_BSV, models["sdpa"](ids, d).logits_BSV,
                                       rtol=1e-5, atol=1e-5)


def test_flex_training_on_cpu_is_a_clear_error():
    model = Transformer(ModelConfig(vocab_size=64, dim=32, num_layers=1, num_heads=4, max_seq_len=32,
                                    attention_backend="flex", moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16)))
    model.init_weights(0)
    with pytest.raises(ValueError, match="flex cannot train on CPU"):
        model(torch.randint(0, 64, (1, 8)))


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="auto, sdpa, flex"):
        ModelConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="auto, sdpa, flex"):
        build_attention_core("flash")


@pytest.mark.gpu
@pytest.mark.parametrize("documents", [False, True])
def test_flex_matches_sdpa_on_gpu(documents):
    dev = torch.device("cuda")
    q, k, v = (t.to(dev, torch.bfloat16) for t in qkv(B=2, H=8, G=2, S=1024, Hd=64))
    docs = doc_ids(2, 1024).to(dev) if documents else None
    ref = SDPACore()(q.float(), k.float(), v.float(), SDPACore().mask(docs, 1024, dev))
    flex = FlexCore()
    got = flex(q, k, v, flex.mask(docs, 1024, dev)).float()
    assert (got - ref).norm() / ref.norm() < 1e-2


def test_the_gpu_paths_resolve():
    """FlexCore's CUDA branch calls this (building a compiled function runs nothing on CPU)."""
    from sonic.models import attention

    assert callable(attention._compiled_flex())


def test_every_registered_name_builds_its_core():
    for name in ATTENTION_BACKENDS:
        assert build_attention_core(name).name == name
