"""On CUDA: routing matches the CPU and does not synchronise with the host where it need not."""
from __future__ import annotations

import pytest
import torch

from bench.common import sync_sites
from sonic.routing import Router, RoutingConfig

pytestmark = pytest.mark.gpu

CONFIGS = [dict(method="topk"), dict(method="topk", order="softmax_topk", renormalize=True),
           dict(method="expert_choice", capacity_factor=1.25)]
ROUNDING = [dict(method="token_rounding", rounding_mode=m, tile_size=64)
            for m in ("nearest", "nearest_score", "balance", "up", "down")]


def _router(cfg, device, seed=0):
    torch.manual_seed(seed)
    router = Router(64, 32, 4, RoutingConfig(**cfg)).train()
    return router.to(device)


def _syncs(fn) -> int:
    """How many synchronising CUDA calls fn makes (torch's sync debug mode)."""
    return len(sync_sites(fn))


@pytest.mark.parametrize("cfg", CONFIGS + ROUNDING, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_cuda_plan_equals_cpu_plan(cfg):
    x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(1))
    _assert_same_plan(_router(cfg, "cpu")(x).plan, _router(cfg, "cuda")(x.cuda()).plan)


def _assert_same_plan(cpu, gpu) -> None:
    for name, a, b in zip(("scores", "token", "expert", "expert_off", "token_off", "by_token"),
                          cpu.tensors(), gpu.tensors()):
        if name == "scores":
            torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(b.cpu(), a), name


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_topk_and_expert_choice_never_sync(cfg):
    router = _router(cfg, "cuda")
    x = torch.randn(4096, 64, device="cuda", requires_grad=True)
    assert _syncs(lambda: router(x)) == 0


@pytest.mark.parametrize("cfg", ROUNDING, ids=lambda c: c["rounding_mode"])
def test_token_rounding_never_syncs(cfg):
    """The kept row count is data dependent, so the plan is padded to a bound instead of sized by it
    (sonic/routing/plan.py): neither the routing nor the triton experts' forward and backward wait."""
    from sonic.kernels import experts

    router = _router(cfg, "cuda")
    x = torch.randn(4096, 64, device="cuda", requires_grad=True)
    w1 = (torch.randn(32, 64, 64, device="cuda") / 8).requires_grad_()
    w2 = (torch.randn(32, 64, 32, device="cuda") / 8).requires_grad_()

    def step():
        out = router(x)
        assert out.plan.num_rows > out.plan.live_rows() or cfg["rounding_mode"] == "down"
        y = experts(x.bfloat16(), w1.bfloat16(), w2.bfloat16(), out.plan, backend="triton")
        (y.float().square().mean() + out.loss).backward()

    step()  # compile and pick the kernels' configs first
    assert _syncs(lambda: router(x)) == 0
    assert _syncs(lambda: experts(x.bfloat16(), w1.bfloat16(), w2.bfloat16(), router(x).plan, backend="triton")
                  .float().sum().backward()) == 0


def test_prefix_centring_matches_cpu_and_never_syncs():
    cfg = dict(method="topk", input_centring="prefix")
    x = torch.randn(4 * 256, 64, generator=torch.Generator().manual_seed(1))
    cpu, gpu = _router(cfg, "cpu"), _router(cfg, "cuda")
    torch.testing.assert_close(gpu.scores(x.cuda(), gpu.weight_ED, 256).cpu(), cpu.scores(x, cpu.weight_ED, 256),
                               rtol=1e-4, atol=1e-4)
    x = x.cuda().requires_grad_()
    assert _syncs(lambda: gpu(x, 256)) == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("cfg", ROUNDING, ids=lambda c: c["rounding_mode"])
def test_token_rounding_on_fresh_batches(cfg, backend):
    """Every batch gives the CPU's plan, and earlier results survive later calls: the torch backend's selection is
    captured once as a CUDA graph and replayed (new inputs into the same captured buffers), the triton backend's is
    one op whose buffers are its own."""
    cpu, gpu = _router(cfg, "cpu"), _router(dict(cfg, backend=backend), "cuda")
    got, want = [], []
    for seed in range(3):
        x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(10 + seed)) * (1 + seed)
        want.append(cpu(x).plan)
        got.append(gpu(x.cuda()).plan)
    for a, b in zip(want, got):
        _assert_same_plan(a, b)
    assert not torch.equal(got[0].expert_offsets_E1, got[1].expert_offsets_E1), "the batches must route differently"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stochastic_token_rounding_draws_per_call(backend):
    """The stochastic rule draws anew on every call (in the torch backend's captured graph, every replay; in the
    triton backend's op, before it), and its counts stay on the tile grid."""
    router = _router(dict(method="token_rounding", rounding_mode="stochastic", tile_size=64, backend=backend), "cuda")
    x = torch.randn(4096, 64, device="cuda")
    counts = [router(x).counts_E for _ in range(6)]
    for c in counts:
        assert bool(((c % 64 == 0) | (c == 4096)).all())
    assert len({tuple(c.tolist()) for c in counts}) > 1, "one draw replayed six times"
