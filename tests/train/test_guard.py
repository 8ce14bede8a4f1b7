"""The non-finite guard: a skipped step leaves weights and AdamW state exactly as they were, for
each optim.implementation; a non-finite loss or an update that could explode the weights is
skipped too; stop raises first; consecutive skips stop the run; no host sync on the fused path."""
import copy

import pytest
import torch

from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.train.config import TrainConfig
from sonic.train.guard import NonFiniteGuard
from sonic.train.optim import OptimConfig, build_optimizer, clip_grad_norm, norm_function

CPU = torch.device("cpu")
IMPLEMENTATIONS = ("fused", "foreach", "for_loop")


def tiny() -> Transformer:
    # fp32 without autocast on any device: the reference experts (auto picks cute on a GPU, which runs bf16 only)
    cfg = ModelConfig(vocab_size=32, dim=16, num_layers=1, num_heads=2,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_dim=8, kernel_backend="reference"))
    model = Transformer(cfg)
    model.init_weights(seed=0)
    return model


def backward(model, seed: int, poison: bool = False) -> torch.Tensor:
    """Gradients of a fixed batch; poison=True puts a NaN in one gradient. Returns the clipped norm."""
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(seed))
    out = model(tokens.to(next(model.parameters()).device))
    (out.logits_BSV.square().mean() + out.router_loss).backward()
    if poison:
        next(model.parameters()).grad.view(-1)[3] = float("nan")
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def snapshot(model, optimizer):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def assert_same(a, b):
    (ma, oa), (mb, ob) = a, b
    for name in ma:
        assert torch.equal(ma[name], mb[name]), name
    assert oa["state"].keys() == ob["state"].keys()
    for idx in oa["state"]:
        for key, value in oa["state"][idx].items():
            assert torch.equal(value, ob["state"][idx][key]), (idx, key)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_skipped_step_changes_nothing_and_the_next_step_is_as_if_it_never_happened(impl):
    runs = {}
    for name, poisoned_step in (("with a NaN step", True), ("without it", False)):
        model = tiny()
        optimizer = build_optimizer(model, OptimConfig(implementation=impl))
        guard = NonFiniteGuard(optimizer, "skip", 3, CPU)
        guard.step(backward(model, seed=1), step=1)
        optimizer.zero_grad()
        if poisoned_step:
            before = snapshot(model, optimizer)
            norm = backward(model, seed=2, poison=True)
            assert not torch.isfinite(norm)
            guard.step(norm, step=2)
            optimizer.zero_grad()
            assert_same(snapshot(model, optimizer), before)  # weights, exp_avg, exp_avg_sq and AdamW's step
        guard.step(backward(model, seed=3), step=3)
        runs[name] = snapshot(model, optimizer), guard.check()
    assert_same(runs["with a NaN step"][0], runs["without it"][0])
    assert (runs["with a NaN step"][1], runs["without it"][1]) == (1, 0)


def test_fused_skip_reads_nothing_back_from_the_device(monkeypatch):
    model = tiny()
    optimizer = build_optimizer(model, OptimConfig(implementation="fused"))
    guard = NonFiniteGuard(optimizer, "skip", 3, CPU, max_update_ratio=1.0)
    norm = backward(model, seed=2, poison=True)

    def host_sync(*args, **kwargs):
        raise AssertionError("the guard read a device value on the host")

    with monkeypatch.context() as m:
        for method in ("item", "tolist", "__bool__", "__float__", "__int__"):
            m.setattr(torch.Tensor, method, host_sync)
        guard.step(norm, step=1, loss=torch.tensor(2.0))
    assert guard.check() == 1
    # the foreach path cannot take found_inf: it does read the flag (as GradScaler does)
    foreach = NonFiniteGuard(build_optimizer(model, OptimConfig(implementation="foreach")), "skip", 3, CPU)
    with monkeypatch.context() as m, pytest.raises(AssertionError, match="host"):
        m.setattr(torch.Tensor, "item", host_sync)
        foreach.step(norm, step=1)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ("fused", "triton"))
def test_fused_guard_does_not_synchronize_on_cuda(impl):
    model = tiny().cuda()
    optimizer = build_optimizer(model, OptimConfig(implementation=impl))
    guard = NonFiniteGuard(optimizer, "skip", 3, torch.device("cuda"), max_update_ratio=1.0)
    before = snapshot(model, optimizer)
    backward(model, seed=2, poison=True)
    loss = torch.tensor(2.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # the trainer's clip (triton: TritonAdamW's norm, also of the weights in the guard) and step
        norm, grad_scale = clip_grad_norm(model.parameters(), 1.0, scale_in_step=True, norm=norm_function(optimizer))
        guard.step(norm, step=1, loss=loss, grad_scale=grad_scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.check() == 1
    after = snapshot(model, optimizer)
    for name in before[0]:
        assert torch.equal(before[0][name], after[0][name]), name


@pytest.mark.parametrize("impl", ("fused", "foreach"))
def test_stop_raises_before_the_optimizer_step(impl):
    model = tiny()
    optimizer = build_optimizer(model, OptimConfig(implementation=impl))
    guard = NonFiniteGuard(optimizer, "stop", 3, CPU)
    guard.step(backward(model, seed=1), step=1)
    optimizer.zero_grad()
    before = snapshot(model, optimizer)
    with pytest.raises(FloatingPointError, match=r"nan at step 2 \(train.nonfinite=stop\).*optim.lr"):
        guard.step(backward(model, seed=2, poison=True), step=2)
    assert_same(snapshot(model, optimizer), before)


def test_consecutive_skips_stop_the_run_whenever_they_are_read():
    model = tiny()
    guard = NonFiniteGuard(build_optimizer(model, OptimConfig()), "skip", 2, CPU)
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    for step, norm in enumerate((nan, one, nan, one), start=1):  # never two in a row
        guard.step(norm, step)
    assert guard.check() == 2
    guard.step(nan, 5)
    guard.step(nan, 6)  # the second in a row: the limit
    guard.step(one, 7)  # a good step later does not undo it
    resumed = NonFiniteGuard(build_optimizer(model, OptimConfig()), "skip", 2, CPU)
    resumed.load_state_dict(guard.state_dict())  # as after a checkpoint
    for g in (guard, resumed):
        with pytest.raises(FloatingPointError, match=r"2 consecutive steps up to step 6.*max_consecutive_skips=2"):
            g.check()
    assert guard.state_dict() == {"skipped": 4, "consecutive": 0, "tripped_at": 6, "last_skipped": 6, "exploded": 0,
                                  "streak_start": 5}


@pytest.mark.parametrize("kw, field", [({"nonfinite": "ignore"}, "train.nonfinite"),
                                       ({"max_consecutive_skips": 0}, "train.max_consecutive_skips")])
def test_bad_nonfinite_config(kw, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**kw)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_non_finite_loss_is_skipped_even_with_finite_gradients(impl):
    """A -inf logit on a target makes the loss inf while softmax - onehot stays finite."""
    model = tiny()
    optimizer = build_optimizer(model, OptimConfig(implementation=impl))
    guard = NonFiniteGuard(optimizer, "skip", 3, CPU)
    guard.step(backward(model, seed=1), step=1, loss=torch.tensor(2.0))
    optimizer.zero_grad()
    norm = backward(model, seed=2)
    before = snapshot(model, optimizer)
    guard.step(norm, step=2, loss=torch.tensor(float("inf")))
    assert_same(snapshot(model, optimizer), before)
    assert guard.check() == 1 and guard.in_streak and guard.streak_start == 2


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_an_update_that_could_explode_the_weights_is_skipped(impl):
    """optim.lr=1e6: AdamW's first step moves every weight by the LR, here ~10^7 times the weights'
    RMS. The step is skipped before it is applied; a sane LR passes."""
    model = tiny()
    optimizer = build_optimizer(model, OptimConfig(implementation=impl))
    guard = NonFiniteGuard(optimizer, "skip", 3, CPU, max_update_ratio=1.0)
    guard.step(backward(model, seed=1), step=1, loss=torch.tensor(2.0))  # at the default LR: applied
    optimizer.zero_grad()
    norm = backward(model, seed=2)
    before = snapshot(model, optimizer)
    n = sum(p.numel() for p in model.parameters())
    rms = torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in model.parameters()])) / n ** 0.5
    for group in optimizer.param_groups:
        group["lr"] = 1.01 * rms.item()  # lr * sqrt(n) just over the weight norm
    guard.step(norm, step=2, loss=torch.tensor(2.0))
    assert_same(snapshot(model, optimizer), before)
    assert guard.check() == 1 and guard.state_dict()["exploded"] == 1
    for group in optimizer.param_groups:
        group["lr"] = 0.99 * rms.item()
    guard.step(norm, step=3, loss=torch.tensor(2.0))
    assert guard.check() == 1 and not guard.in_streak
    name, weight = next(iter(model.state_dict().items()))
    assert not torch.equal(weight, before[0][name])  # applied


def test_stop_names_an_update_that_could_explode_the_weights():
    model = tiny()
    optimizer = build_optimizer(model, OptimConfig(lr=1e6))
    guard = NonFiniteGuard(optimizer, "stop", 3, CPU, max_update_ratio=1.0)
    with pytest.raises(FloatingPointError, match=r"update at LR 1e\+06 could exceed train.max_update_ratio=1.0 x the "
                                                 r"weight norm at step 1"):
        guard.step(backward(model, seed=1), step=1)


def test_counts_from_an_older_checkpoint_load():
    guard = NonFiniteGuard(build_optimizer(tiny(), OptimConfig()), "skip", 2, CPU)
    guard.load_state_dict({"skipped": 3, "consecutive": 1, "tripped_at": 0, "last_skipped": 9})  # no newer counts
    assert guard.state_dict() == {"skipped": 3, "consecutive": 1, "tripped_at": 0, "last_skipped": 9, "exploded": 0,
                                  "streak_start": 0}
    assert guard.in_streak
