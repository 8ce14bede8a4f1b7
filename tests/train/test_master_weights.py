"""One GPU holds its weights in parallel.param_dtype (bf16) with fp32 masters in TritonAdamW: where that applies,
and checkpoints that hold the masters as the model's weights, so they move to and from runs of fp32 weights
unchanged; the same without masters (optim.master_weights=none). The step itself (the kernel with and without a
master): tests/train/test_triton_adamw.py."""
import pytest
import torch
import torch.distributed.checkpoint as dcp

from sonic.models.loading import read_dcp
from sonic.parallel import DistInfo, ParallelConfig, weights_dtype
from sonic.train.checkpoint import Checkpointer
from sonic.train.optim import OptimConfig, TritonAdamW, build_optimizer
from tests.helpers import compose_config
from tests.train.test_guard import tiny


def _model():
    return tiny()  # fp32, reference experts


def _groups(model):
    params = list(model.parameters())
    return [{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.0}]


def _with_masters(model, moment_dtype=None) -> TritonAdamW:
    """bf16 weights, and a state as after three steps: masters off the bf16 grid, moments set (nothing here runs
    the optimizer's kernel, so this works on the CPU)."""
    optimizer = TritonAdamW(_groups(model), lr=1e-3, compute_dtype=torch.bfloat16, moment_dtype=moment_dtype)
    gen = torch.Generator().manual_seed(1)
    for p, master in optimizer.masters().items():
        state = optimizer.state[p]
        master.add_(torch.randn(master.shape, generator=gen) * 1e-3)
        p.data.copy_(master)
        state["exp_avg"].copy_(torch.randn(master.shape, generator=gen))
        state["exp_avg_sq"].copy_(torch.rand(master.shape, generator=gen))
        state["step"].fill_(3)
    return optimizer


def _save(tmp_path, model, optimizer):
    return Checkpointer(tmp_path / "checkpoints", keep_last=2).save(3, model, optimizer, {}, "model: {}\n")


def test_the_optimizer_keeps_fp32_masters_and_the_weights_become_bf16():
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = TritonAdamW(_groups(model), lr=1e-3, compute_dtype=torch.bfloat16)
    masters = optimizer.masters()
    assert len(masters) == len(before)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[name].bfloat16())
        assert masters[p].dtype == torch.float32 and torch.equal(masters[p], before[name])
        assert optimizer.state[p]["exp_avg"].dtype == torch.float32
    assert TritonAdamW(_groups(_model()), lr=1e-3).masters() == {}


def test_a_checkpoint_holds_the_masters_as_the_weights(tmp_path):
    model = _model()
    optimizer = _with_masters(model)
    path = _save(tmp_path, model, optimizer)
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert not [k for k in keys if k.endswith(".master")] and any(k.endswith(".exp_avg") for k in keys)
    fp32 = _model()
    state = {"model": fp32.state_dict()}
    read_dcp(state, path)  # as load_model and an HF export read it
    names = dict(model.named_parameters())
    for name, saved in state["model"].items():
        if name in names:
            assert saved.dtype == torch.float32 and torch.equal(saved, optimizer.masters()[names[name]]), name


def test_a_checkpoint_with_masters_resumes_exactly_either_way(tmp_path):
    model = _model()
    optimizer = _with_masters(model)
    path = _save(tmp_path, model, optimizer)
    # into bf16 weights with masters: masters, weights, moments and step as saved
    again = _model()
    again_opt = TritonAdamW(_groups(again), lr=1e-3, compute_dtype=torch.bfloat16)
    Checkpointer(tmp_path / "checkpoints", keep_last=2).load(path, again, again_opt)
    for p, q in zip(again.parameters(), model.parameters()):
        assert torch.equal(again_opt.masters()[p], optimizer.masters()[q]) and torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert again_opt.state[p][key].dtype == torch.float32
            assert torch.equal(again_opt.state[p][key], optimizer.state[q][key]), key
    # into fp32 weights (torch's AdamW, as FSDP-2 or parallel.param_dtype=fp32 runs): the masters are the weights
    fp32 = _model()
    fp32_opt = torch.optim.AdamW(_groups(fp32), lr=1e-3, foreach=False)
    Checkpointer(tmp_path / "checkpoints", keep_last=2).load(path, fp32, fp32_opt)
    for p, q in zip(fp32.parameters(), model.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, optimizer.masters()[q])
        assert torch.equal(fp32_opt.state[p]["exp_avg_sq"], optimizer.state[q]["exp_avg_sq"])
    # and back: a checkpoint of fp32 weights loads into the masters
    path = Checkpointer(tmp_path / "other", keep_last=2).save(4, fp32, fp32_opt, {}, "model: {}\n")
    back = _model()
    back_opt = TritonAdamW(_groups(back), lr=1e-3, compute_dtype=torch.bfloat16)
    Checkpointer(tmp_path / "other", keep_last=2).load(path, back, back_opt)
    for p, q in zip(back.parameters(), fp32.parameters()):
        assert torch.equal(back_opt.masters()[p], q) and torch.equal(p, q.bfloat16())


def test_a_checkpoint_of_bf16_moments_resumes_exactly_and_moves_to_fp32_moments(tmp_path):
    """optim.moment_dtype=bf16: saved as they are held; a resume gets them back exactly, an fp32-moment run gets them
    as fp32, and a checkpoint of fp32 moments loads into bf16 ones rounded."""
    model = _model()
    optimizer = _with_masters(model, torch.bfloat16)
    assert all(state["exp_avg_sq"].dtype == torch.bfloat16 for state in optimizer.state.values())
    path = _save(tmp_path, model, optimizer)
    for moment_dtype in (torch.bfloat16, None):
        again = _model()
        again_opt = TritonAdamW(_groups(again), lr=1e-3, compute_dtype=torch.bfloat16, moment_dtype=moment_dtype)
        Checkpointer(tmp_path / "checkpoints", keep_last=2).load(path, again, again_opt)
        for p, q in zip(again.parameters(), model.parameters()):
            assert torch.equal(again_opt.masters()[p], optimizer.masters()[q]) and torch.equal(p, q)
            for key in ("exp_avg", "exp_avg_sq"):
                loaded = again_opt.state[p][key]
                assert loaded.dtype == (moment_dtype or torch.float32), (moment_dtype, key)
                assert torch.equal(loaded, optimizer.state[q][key].to(loaded.dtype)), key
    fp32_model = _model()
    fp32 = _with_masters(fp32_model)
    path = Checkpointer(tmp_path / "fp32", keep_last=2).save(3, fp32_model, fp32, {}, "model: {}\n")
    back = _model()
    back_opt = TritonAdamW(_groups(back), lr=1e-3, compute_dtype=torch.bfloat16, moment_dtype=torch.bfloat16)
    Checkpointer(tmp_path / "fp32", keep_last=2).load(path, back, back_opt)
    for p, q in zip(back_opt._params(), fp32._params()):
        assert torch.equal(back_opt.state[p]["exp_avg"], fp32.state[q]["exp_avg"].bfloat16())


def test_without_masters_a_checkpoint_holds_fp32_weights_and_resumes_exactly_either_way(tmp_path):
    """optim.master_weights=none: the bf16 weights are saved as fp32 (what fp32 weights or masters would save), a
    resume gets them back exactly, a run with masters gets them as its masters, and a checkpoint with masters
    loads into bf16 weights rounded to nearest, with no master kept."""
    model = _model()
    optimizer = TritonAdamW(_groups(model), lr=1e-3, compute_dtype=torch.bfloat16, keep_masters=False)
    assert optimizer.masters() == {} and all(p.dtype == torch.bfloat16 for p in model.parameters())
    gen = torch.Generator().manual_seed(2)
    for p in model.parameters():
        p.data.add_(torch.randn(p.shape, generator=gen).bfloat16() * 1e-2)
        optimizer.state[p]["exp_avg"].copy_(torch.randn(p.shape, generator=gen))
        optimizer.state[p]["step"].fill_(3)
    path = _save(tmp_path, model, optimizer)
    state = {"model": _model().state_dict()}
    read_dcp(state, path)
    names = dict(model.named_parameters())
    for name, saved in state["model"].items():
        if name in names:
            assert saved.dtype == torch.float32 and torch.equal(saved, names[name].float()), name
    for keep_masters in (False, True):
        again = _model()
        again_opt = TritonAdamW(_groups(again), lr=1e-3, compute_dtype=torch.bfloat16, keep_masters=keep_masters)
        Checkpointer(tmp_path / "checkpoints", keep_last=2).load(path, again, again_opt)
        for p, q in zip(again.parameters(), model.parameters()):
            assert p.dtype == torch.bfloat16 and torch.equal(p, q), keep_masters
            assert torch.equal(again_opt.state[p]["exp_avg"], optimizer.state[q]["exp_avg"])
            assert again_opt.state[p]["exp_avg"].dtype == torch.float32
        assert len(again_opt.masters()) == (len(names) if keep_masters else 0)
        for p, master in again_opt.masters().items():
            assert torch.equal(master, p.float())
    masters_model = _model()
    masters = _with_masters(masters_model)
    path = Checkpointer(tmp_path / "masters", keep_last=2).save(3, masters_model, masters, {}, "model: {}\n")
    back = _model()
    back_opt = TritonAdamW(_groups(back), lr=1e-3, compute_dtype=torch.bfloat16, keep_masters=False)
    Checkpointer(tmp_path / "masters", keep_last=2).load(path, back, back_opt)
    for p, q in zip(back.parameters(), masters_model.parameters()):
        assert torch.equal(p, masters.masters()[q].bfloat16()) and "master" not in back_opt.state[p]


def test_master_weights_is_fp32_or_none():
    with pytest.raises(ValueError, match="optim.master_weights='bf16' is not one of none, fp32"):
        OptimConfig(master_weights="bf16")


@pytest.mark.gpu
def test_master_weights_none_builds_an_optimizer_without_masters():
    model = _model().cuda()
    optimizer = build_optimizer(model, OptimConfig(master_weights="none"), compute_dtype=torch.bfloat16)
    assert optimizer.masters() == {} and all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(state["exp_avg"].dtype == torch.bfloat16 for state in optimizer.state.values())  # moments: auto
    fp32 = build_optimizer(_model().cuda(), OptimConfig(master_weights="none"))  # weights fp32 (FSDP, grad_accum)
    assert all(p.dtype == torch.float32 for p in fp32._params())


@pytest.mark.parametrize(("device", "mesh", "param_dtype", "bf16_step", "grad_accum", "expected"), [
    ("cuda", None, "bf16", True, 1, torch.bfloat16),  # one GPU: bf16 weights, fp32 masters
    ("cuda", None, "fp32", True, 1, None),  # asked for fp32 weights
    ("cuda", None, "bf16", False, 1, None),  # train.precision=fp32: the step reads fp32 weights
    ("cuda", None, "bf16", True, 2, None),  # micro-batch gradients are summed in fp32
    ("cuda", "a mesh", "bf16", True, 1, None),  # FSDP-2 casts as it gathers
    ("cpu", None, "bf16", True, 1, None),  # CPU runs stay fp32
])
def test_where_one_gpu_holds_bf16_weights(device, mesh, param_dtype, bf16_step, grad_accum, expected):
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device(device), mesh=mesh)
    assert weights_dtype(ParallelConfig(param_dtype=param_dtype), info, bf16_step, grad_accum) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("master_weights", ["fp32", "none"])
def test_the_trainer_on_one_gpu_trains_bf16_weights_and_resumes(tmp_path, monkeypatch, master_weights):
    import sonic.train.trainer as trainer

    built = []
    monkeypatch.setattr(trainer, "build_optimizer", lambda *a, **k: built.append(build_optimizer(*a, **k)) or built[-1])
    common = ["train.device=cuda", "model.num_layers=2", "train.micro_batch_size=2", "train.seq_len=64",
              "train.log_every=1", "train.eval_every=0", "train.save_every=2", "train.progress=false",
              "parallel.compile=false", f"optim.master_weights={master_weights}", "train.steps=4"]
    straight = trainer.train(compose_config(*common, f"train.run_dir={tmp_path / 'a'}"))
    optimizer = built[-1]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert len(optimizer.masters()) == (len(params) if master_weights == "fp32" else 0)
    for p, master in optimizer.masters().items():
        assert torch.equal(p, master.bfloat16())  # the weights are the masters, rounded, after every step
    first = trainer.train(compose_config(*common[:-1], "train.steps=2", f"train.run_dir={tmp_path / 'b'}"))
    resumed = trainer.train(compose_config(*common, "train.resume=auto", f"train.run_dir={tmp_path / 'b'}"))
    losses = [r["loss"] for r in straight]
    assert [r["loss"] for r in first + resumed] == pytest.approx(losses, rel=1e-3)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
