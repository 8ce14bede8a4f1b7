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
    sdpa, flex = SDPACore(16), FlexCore(16)
    want = sdpa(q, k, v, sdpa.mask(docs, q.shape[2], CPU))
    got = flex(q, k, v, flex.mask(docs, q.shape[2], CPU))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_document_mask_really_blocks():
    """Changing a value in document 0 leaves the outputs of document 1 unchanged (both cores)."""
    q, k, v = qkv(B=1)
    docs = torch.tensor([[0] * 20 + [1] * 28])
    for core in (SDPACore(16), FlexCore(16)):
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
    with pytest.raises(ValueError, match="auto, sdpa, flex, fa4"):
        ModelConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="auto, sdpa, flex, fa4"):
        build_attention_core("flash", 64)


@pytest.mark.gpu
@pytest.mark.parametrize("documents", [False, True])
def test_flex_matches_sdpa_on_gpu(documents):
    dev = torch.device("cuda")
    q, k, v = (t.to(dev, torch.bfloat16) for t in qkv(B=2, H=8, G=2, S=1024, Hd=64))
    docs = doc_ids(2, 1024).to(dev) if documents else None
    ref = SDPACore(64)(q.float(), k.float(), v.float(), SDPACore(64).mask(docs, 1024, dev))
    flex = FlexCore(64)
    got = flex(q, k, v, flex.mask(docs, 1024, dev)).float()
    assert (got - ref).norm() / ref.norm() < 1e-2


def test_the_gpu_paths_resolve():
    """FlexCore's CUDA branch calls this (building a compiled function runs nothing on CPU)."""
    from sonic.models import attention

    assert callable(attention._compiled_flex())


def test_every_registered_name_builds_its_core():
    for name in ATTENTION_BACKENDS:
        assert build_attention_core(name, 64).name == name


def test_fa4_where_it_cannot_run_is_a_clear_error_and_auto_falls_back():
    """On a CPU (and, below, for a head size it does not take) fa4 refuses with what to do instead, while auto
    takes sdpa and trains; fa4 never takes document masks."""
    from sonic.kernels.fa4 import unavailable_reason

    cfg = dict(vocab_size=64, dim=32, num_layers=1, num_heads=4, max_seq_len=32,
               moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16))
    ids = torch.randint(0, 64, (1, 8))
    model = Transformer(ModelConfig(attention_backend="fa4", **cfg))
    model.init_weights(0)
    with pytest.raises(ValueError, match="fa4 cannot run here: it needs a CUDA GPU.*attention_backend=auto"):
        model(ids)
    auto = Transformer(ModelConfig(attention_backend="auto", **cfg))
    auto.init_weights(0)
    assert auto.attn_core.mask(None, 8, CPU)[0] is auto.attn_core.sdpa
    auto(ids).logits_BSV.sum().backward()
    with pytest.raises(ValueError, match="plain causal attention only.*auto or flex"):
        build_attention_core("fa4", 64).mask(doc_ids(1, 8), 8, CPU)
    assert "head size 80 is not one of (64, 128)" in unavailable_reason(torch.device("cuda"), 80)


@pytest.fixture
def broken_fa4(tmp_path, monkeypatch):
    """A flash_attn package that is found but whose kernels fail to import, as a CuTe DSL it cannot use does;
    the import cache and the imported modules are put back afterwards."""
    import importlib
    import sys

    from sonic.kernels import fa4

    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "cute" / "interface.py").write_text("raise ImportError('cutlass-dsl 9.9 expected')\n")
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "flash_attn"}
    for k in saved:
        del sys.modules[k]
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    fa4.package_problem.cache_clear()
    # a Hopper device as far as the checks before the package's can tell, on any machine
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    yield
    for k in [k for k in sys.modules if k.split(".")[0] == "flash_attn"]:
        del sys.modules[k]
    sys.modules.update(saved)
    fa4.package_problem.cache_clear()


def test_a_broken_fa4_install_sends_auto_to_sdpa_and_fa4_says_why(broken_fa4):
    """Installed but not importable: auto takes sdpa with one warning naming the error, the fa4 backend refuses with
    it and the fix, and nothing is imported again on the next call."""
    from sonic.kernels.fa4 import package_problem

    cuda = torch.device("cuda")
    with pytest.warns(UserWarning, match=r"installed but does not import \(ImportError: cutlass-dsl 9.9 expected\)"):
        assert build_attention_core("auto", 64)._pick(False, cuda).name == "sdpa"
    assert package_problem.cache_info().misses == 1
    with pytest.raises(ValueError, match="fa4 cannot run here: flash-attn-4 is installed but does not import.*"
                                         "pip install 'flash-attn-4==4.0.0b36'.*attention_backend=auto"):
        build_attention_core("fa4", 64).mask(None, 8, cuda)
    assert package_problem.cache_info().misses == 1


def fa4_gpu_or_skip() -> torch.device:
    """The GPU for fa4's GPU tests: skipped where fa4 cannot run, except an install that is found but does not
    import, which fails (auto would quietly run sdpa there)."""
    from sonic.kernels.fa4 import unavailable_reason

    dev = torch.device("cuda")
    reason = unavailable_reason(dev, 64)
    if reason is not None and "does not import" in reason:
        pytest.fail(reason)
    if reason is not None:
        pytest.skip(f"fa4: {reason}")
    return dev


@pytest.mark.gpu
@pytest.mark.parametrize("gqa", [False, True])
def test_fa4_matches_sdpa_forward_and_backward_on_gpu(gqa):
    """FlashAttention-4's custom ops against fp32 SDPA on fresh inputs, outputs and all three input gradients."""
    dev = fa4_gpu_or_skip()
    q, k, v = (t.to(dev, torch.bfloat16).requires_grad_() for t in qkv(B=2, H=8, G=2 if gqa else 8, S=1024, Hd=64))
    dout = torch.randn_like(q)
    core = build_attention_core("fa4", 64)
    got = core(q, k, v, core.mask(None, 1024, dev))
    got.backward(dout)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = SDPACore(64)(qf, kf, vf, None)
    ref.backward(dout.float())
    for a, b in ((got, ref), (q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)):
        assert torch.isfinite(a).all()
        assert (a.float() - b).norm() / b.norm() < 1e-2


@pytest.mark.gpu
def test_fa4_attention_compiles_into_one_graph_on_gpu():
    """The block's compile keeps fa4 in its graph: its forward and backward are custom ops, no graph break."""
    dev = fa4_gpu_or_skip()
    core = build_attention_core("fa4", 64)
    q, k, v = (t.to(dev, torch.bfloat16).requires_grad_() for t in qkv(B=1, H=4, G=4, S=256, Hd=64))
    want = core(q, k, v, None)
    got = torch.compile(lambda q, k, v: core(q, k, v, None), fullgraph=True)(q, k, v)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    assert q.grad is not None and torch.isfinite(q.grad).all()
