"""LM head + cross-entropy backends against F.cross_entropy on the full logits."""
import pytest
import torch
import torch.nn.functional as F

from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.models import loss as loss_mod
from sonic.registry import Entry

CPU = torch.device("cpu")


def problem(T=37, D=16, V=50, seed=0, ignored=0.3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.rand(T, generator=g) < ignored] = -100
    return h, w, labels


def reference(h, w, labels):
    return F.cross_entropy((h @ w.T).double(), labels, ignore_index=-100)


@pytest.mark.parametrize("chunk_tokens", [1, 8, 37, 100])
def test_chunked_matches_full_logits(monkeypatch, chunk_tokens):
    h, w, labels = problem(seed=chunk_tokens)
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", chunk_tokens * w.shape[0])  # several chunks, a ragged last
    got = loss_mod.chunked_loss(h, w, labels)
    (gh, gw) = torch.autograd.grad(3.0 * got, (h, w))  # a non-unit upstream gradient
    want = reference(h, w, labels)
    (wh, ww) = torch.autograd.grad(3.0 * want, (h, w))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gh, wh)
    torch.testing.assert_close(gw, ww)


def test_chunked_bf16_close_to_fp64():
    h, w, labels = problem(T=64, D=32, V=300, dtype=torch.float64)
    want = reference(h, w, labels)
    (wh, ww) = torch.autograd.grad(want, (h, w))
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    got = loss_mod.chunked_loss(hb, wb, labels)
    gh, gw = torch.autograd.grad(got, (hb, wb))
    assert abs(got.item() - want.item()) / want.item() < 1e-2
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    for g, r in ((gh, wh), (gw, ww)):
        assert (g.double() - r).norm() / r.norm() < 2e-2


def test_no_labels_is_zero_loss_and_zero_grad():
    h, w, _ = problem()
    labels = torch.full((h.shape[0],), -100)
    got = loss_mod.chunked_loss(h, w, labels)
    assert got.item() == 0.0
    gh, gw = torch.autograd.grad(got, (h, w))
    assert not gh.any() and not gw.any()


@pytest.mark.parametrize("backend", ["torch", "chunked"])
def test_model_loss_equals_cross_entropy_of_its_logits(backend):
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, max_seq_len=32, loss_backend=backend,
                      tie_embeddings=backend == "chunked", moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16))
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    ids, labels = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    labels[0, :3] = -100
    out = model(ids, labels_BS=labels)
    assert out.logits_BSV is None
    want = F.cross_entropy(model(ids).logits_BSV.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_bad_backend_names_the_choices_or_the_package():
    with pytest.raises(ValueError, match="torch, chunked, liger, cce"):
        ModelConfig(loss_backend="fused")
    for name, pip in (("liger", "liger-kernel"), ("cce", "cut-cross-entropy")):
        reason = loss_mod.loss_unavailable_reason(name, CPU)
        assert reason is not None and "CUDA" in reason
        with pytest.raises(ValueError, match=f"loss_backend='{name}' cannot run here"):
            loss_mod.get_loss_fn(name, CPU)
        assert loss_mod.LOSS_BACKENDS.entries[name].extra == pip


def test_every_registered_name_loads_its_function():
    assert loss_mod.get_loss_fn("torch", CPU) is loss_mod.torch_loss
    assert loss_mod.get_loss_fn("chunked", CPU) is loss_mod.chunked_loss


def test_missing_package_names_the_pip_install(monkeypatch):
    monkeypatch.setitem(loss_mod.LOSS_BACKENDS.entries, "liger",
                        Entry("liger", "sonic.models.loss:liger_loss", package="sonic_no_such_module", extra="liger-kernel"))
    reason = loss_mod.loss_unavailable_reason("liger", torch.device("cuda"))
    assert "pip install liger-kernel" in reason
    with pytest.raises(ValueError, match="pip install liger-kernel"):
        loss_mod.get_loss_fn("liger", torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["chunked", "liger", "cce"])
def test_gpu_backends_match_fp32_reference(backend):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    T, D, V = 4096, 512, 32000
    h = (torch.randn(T, D, device=dev, generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, D, device=dev, generator=g) * 0.05).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (T,), device=dev, generator=g)
    labels[::7] = -100
    try:
        fn = loss_mod.get_loss_fn(backend, dev)
    except ValueError as err:
        pytest.skip(str(err))
    got = fn(h, w, labels)
    gh, gw = torch.autograd.grad(got, (h, w))
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = F.cross_entropy(hf @ wf.T, labels, ignore_index=-100)
    wh, ww = torch.autograd.grad(want, (hf, wf))
    assert abs(got.item() - want.item()) / want.item() < 5e-3
    for a, b in ((gh, wh), (gw, ww)):
        assert torch.isfinite(a).all()
        assert (a.float() - b).norm() / b.norm() < 2e-2


@pytest.mark.gpu
def test_chunked_sums_the_head_gradient_in_fp32_on_cuda():
    """The bf16 head's gradient is summed over chunks inside the GEMM, in fp32: no chunk's product is rounded to
    bf16 first (that rounding alone is ~3e-3 relative)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = [torch.randn(256, 512, device="cuda", generator=g).bfloat16() for _ in range(3)]
    b = [torch.randn(512, 128, device="cuda", generator=g).bfloat16() for _ in range(3)]
    acc = torch.zeros(256, 128, device="cuda")
    for x, y in zip(a, b):
        loss_mod._accumulate_mm(acc, x, y)
    want = sum(x.double() @ y.double() for x, y in zip(a, b))
    assert acc.dtype == torch.float32
    torch.testing.assert_close(acc.double(), want, rtol=1e-4, atol=1e-3)


def check_triton_ce_chunk(device: str, V: int = 5000) -> None:
    """The Triton chunk kernel against _ce_chunk (fp32 math on the same bf16/fp16 logits): loss and gradient, with
    ignored rows, labels at both ends of the vocabulary, and a V that leaves the last block of a row partial."""
    from sonic.kernels.triton.cross_entropy import BLOCK_V, ce_chunk

    assert V % BLOCK_V
    g = torch.Generator().manual_seed(V)
    for dtype in (torch.bfloat16, torch.float16):
        logits = (4 * torch.randn(7, V, generator=g)).to(dtype).to(device)
        labels = torch.tensor([0, V - 1, -100, 17, V // 2, -100, 3]).to(device)
        inv_count = torch.tensor(1 / 5, device=device)
        for rows in (slice(None), slice(2, 3)):  # every row, and a chunk whose rows are all ignored
            want_loss, want_grad = loss_mod._ce_chunk(logits[rows], labels[rows], inv_count)
            got_loss, got_grad = ce_chunk(logits[rows].contiguous(), labels[rows], inv_count, loss_mod.IGNORE_INDEX)
            assert got_grad.dtype == dtype and got_loss.dtype == torch.float32
            torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=1e-2, atol=1e-6)
    print("ce chunk ok")


def _ce_interpreter_main() -> None:
    from tests.helpers import patch_triton_interpreter

    patch_triton_interpreter()
    check_triton_ce_chunk("cpu")
    check_triton_ce_chunk("cpu", V=100)


def test_triton_ce_chunk_in_the_interpreter():
    from tests.helpers import run_in_triton_interpreter

    run_in_triton_interpreter("import tests.models.test_loss as t; t._ce_interpreter_main()", "ce chunk ok")


@pytest.mark.gpu
def test_triton_ce_chunk_on_the_gpu():
    check_triton_ce_chunk("cuda")
    check_triton_ce_chunk("cuda", V=100352 + 1)  # sonic_7b's vocabulary, plus one for a partial block


@pytest.mark.gpu
def test_chunked_bf16_on_cuda_matches_the_torch_backend(monkeypatch):
    """The chunked backend end to end on CUDA (Triton chunk kernel, fp32 head-gradient sum) over several chunks."""
    h, w, labels = problem(T=300, D=64, V=3000, dtype=torch.float64)
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 64 * w.shape[0])  # 5 chunks, a ragged last
    hb, wb = (t.detach().bfloat16().cuda().requires_grad_() for t in (h, w))
    want = loss_mod.torch_loss(hb, wb, labels.cuda())  # the same bf16 logits, F.cross_entropy in fp32
    wh, ww = torch.autograd.grad(want, (hb, wb))
    got = loss_mod.chunked_loss(hb, wb, labels.cuda())
    gh, gw = torch.autograd.grad(got, (hb, wb))
    assert abs(got.item() - want.item()) / want.item() < 1e-4  # a logit may round apart by one bf16 ulp
    for g, r in ((gh, wh), (gw, ww)):
        assert (g.double() - r.double()).norm() / r.double().norm() < 1e-2
