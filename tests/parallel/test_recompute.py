"""Activation checkpointing and torch.compile must not change routing: a recomputed forward
routes every token as the original did, and router buffers are updated once per forward."""
import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointError
from torch._dynamo.utils import counters

import sonic.routing.token_rounding as token_rounding_module
from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.parallel import DistInfo, ParallelConfig, parallelize
from sonic.routing.config import RoutingConfig

SINGLE = DistInfo(0, 1, 0, torch.device("cpu"), None)


def model_config(rounding_mode: str) -> ModelConfig:
    routing = RoutingConfig(method="token_rounding", rounding_mode=rounding_mode, tile_size=4)
    return ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=2, max_seq_len=32,
                       moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, kernel_backend="reference",
                                     routing=routing))


def train_steps(rounding_mode: str, parallel: ParallelConfig, steps: int = 3):
    """Losses, grads (accumulated over the steps) and router buffers after `steps` forward/backward passes."""
    torch.manual_seed(0)
    model = Transformer(model_config(rounding_mode))
    model.init_weights(seed=0)
    model = parallelize(model, parallel, SINGLE)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)  # the stochastic rounding draws from this stream
        out = model(torch.randint(0, 64, (2, 15)))  # 30 tokens: counts land off the tile grid
        loss = out.logits_BSV.logsumexp(-1).mean() + out.router_loss
        loss.backward()
        losses.append(loss.item())
    clean = lambda name: name.replace("_checkpoint_wrapped_module.", "")  # noqa: E731
    grads = {clean(n): p.grad.clone() for n, p in model.named_parameters()}
    buffers = {clean(n): b.clone() for n, b in model.named_buffers() if "balance" in n}
    return losses, grads, buffers


def assert_same(got, want):
    assert got[0] == want[0], "losses differ"
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=0, atol=0, msg=f"grad {name}")
    for name, b in want[2].items():
        assert torch.equal(got[2][name], b), f"{name}: {got[2][name].tolist()} != {b.tolist()}"


@functools.lru_cache(maxsize=None)
def eager(rounding_mode: str, steps: int = 3):
    return train_steps(rounding_mode, ParallelConfig(), steps)


@pytest.mark.parametrize("rounding_mode, ac", [("balance", "full"), ("balance", "selective"),
                                               ("stochastic", "full")])
def test_checkpointing_routes_as_without(rounding_mode, ac):
    want = eager(rounding_mode)
    if rounding_mode == "balance":  # the residual really moves, so a double update would show
        assert any(b.abs().sum() > 0 for b in want[2].values())
    assert_same(train_steps(rounding_mode, ParallelConfig(activation_checkpoint=ac, ac_every=2)), want)


def test_recompute_that_updates_buffers_is_caught(monkeypatch):
    """The check above fails if a recompute updated the balance residual a second time
    (or the recompute itself fails, when the changed routing changes the row count)."""
    want = eager("balance")
    monkeypatch.setattr(token_rounding_module, "recomputing", lambda: False)
    with pytest.raises((AssertionError, CheckpointError)):
        assert_same(train_steps("balance", ParallelConfig(activation_checkpoint="full")), want)


def test_compiled_blocks_with_checkpointing():
    """Blocks really compile under AC (graphs captured) and route and train exactly as in eager."""
    torch._dynamo.reset()
    counters.clear()
    want = eager("balance", steps=1)
    got = train_steps("balance", ParallelConfig(activation_checkpoint="full", compile=True,
                                                compile_backend="aot_eager"), steps=1)
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-5, atol=1e-7, msg=f"grad {name}")
    for name, b in want[2].items():
        assert torch.equal(got[2][name], b), name
    torch._dynamo.reset()
