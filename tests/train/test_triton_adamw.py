"""optim.implementation=triton (TritonAdamW, sonic/kernels/triton/adamw.py) takes torch's AdamW step: with the clip
as its divisor, across param groups and tensor sizes that do and do not fill the kernel's blocks, over a skipped
step, and across a checkpoint moved between it and torch's implementations; the same with bf16 parameters and
fp32 masters (compute_dtype), and without masters. On the CPU through Triton's interpreter, and on the GPU; and torch's fused AdamW
takes the clip as a divisor with the same result."""
import copy

import pytest
import torch

import sonic.kernels.triton.adamw as kernel
from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.train.optim import (OptimConfig, TritonAdamW, build_optimizer, clip_grad_norm, global_norm,
                               norm_function, optimizer_step, takes_grad_scale)
from tests.helpers import run_in_triton_interpreter

SHAPES = ((3000,), (64, 70), (5,), (2048,))  # 3000: a partial second block; 2048: exactly one (BLOCK)
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}


def _params(device: str) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]


def _groups(params):
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]


def _set_grads(params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.device)


def check(device: str) -> None:
    ref_params, our_params = _params(device), _params(device)
    ref = torch.optim.AdamW(_groups(ref_params), foreach=False, **HYPER)
    ours = TritonAdamW(_groups(our_params), **HYPER)
    assert takes_grad_scale(ours)
    # (max_norm, skipped): a clipping step, a step under the norm, a skipped step, a clipping one after it
    for seed, (max_norm, skipped) in enumerate(((1.0, False), (1e3, False), (1.0, True), (0.5, False))):
        for params in (ref_params, our_params):
            _set_grads(params, seed)
        grads = [p.grad.clone() for p in our_params]
        norm, grad_scale = clip_grad_norm(our_params, max_norm, scale_in_step=True, norm=norm_function(ours))
        assert (grad_scale is not None) and (grad_scale > 1).item() == (max_norm < 100)
        before = copy.deepcopy((our_params, ours.state_dict()))
        launches = []  # tensors per launch: one launch per param group, whatever its number of tensors
        real = kernel.adamw_tensors_
        kernel.adamw_tensors_ = lambda params, *args, **kw: (launches.append(len(params)), real(params, *args, **kw))
        try:
            optimizer_step(ours, grad_scale, found_inf=torch.tensor(float(skipped), device=device))
        finally:
            kernel.adamw_tensors_ = real
        assert launches == [2, 2], launches
        for p, g in zip(our_params, grads):
            assert torch.equal(p.grad, g)  # the divisor is applied as the kernel reads: the gradient is not written
        if skipped:
            for p, q in zip(our_params, before[0]):
                assert torch.equal(p, q)
            for idx, state in ours.state_dict()["state"].items():
                for key, value in state.items():
                    assert torch.equal(value, before[1]["state"][idx][key]), (idx, key)
            continue
        ref_norm, _ = clip_grad_norm(ref_params, max_norm)
        torch.testing.assert_close(norm, ref_norm)
        ref.step()
        for p, q in zip(our_params, ref_params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours.state[p][key], ref.state[q][key], rtol=1e-5, atol=1e-7)
            assert ours.state[p]["step"].item() == ref.state[q]["step"].item() == seed + 1 - (seed > 2)
    moved = max((p - q).abs().max().item() for p, q in zip(our_params, _params(device)))
    assert moved > 1e-3  # the steps did something
    # a checkpoint moves both ways between it and torch's (whose step count lives on the CPU)
    theirs_params = [torch.nn.Parameter(p.detach().clone()) for p in our_params]
    theirs = torch.optim.AdamW(_groups(theirs_params), foreach=False, **HYPER)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))  # load_state_dict would alias the tensors
    again_params = [torch.nn.Parameter(p.detach().clone()) for p in our_params]
    again = TritonAdamW(_groups(again_params), **HYPER)
    again.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for params in (theirs_params, again_params):
        _set_grads(params, 10)
    theirs.step()
    again.step()
    for p, q in zip(again_params, theirs_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert again.state[p]["step"].device == p.device and again.state[p]["step"].item() == 4
    # an empty parameter beside another takes no block of their launch, and alone no launch
    empty, full = torch.nn.Parameter(torch.zeros(0, device=device)), torch.nn.Parameter(torch.ones(3, device=device))
    opt = TritonAdamW([{"params": [empty, full]}, {"params": [torch.nn.Parameter(torch.zeros(0, device=device))]}],
                      **HYPER)
    for p in (empty, full, *opt.param_groups[1]["params"]):
        p.grad = torch.ones_like(p)
    opt.step()
    assert full.lt(1).all() and opt.state[empty]["step"].item() == 1


def check_masters(device: str) -> None:
    """compute_dtype=bf16: the parameters become bf16 and fp32 masters take torch's fp32 step on the same (bf16)
    gradients; each parameter is its master rounded; a skipped step moves nothing; the state's round trips keep
    the masters and fp32 moments."""
    ref_params, our_params = _params(device), _params(device)
    ref = torch.optim.AdamW(_groups(ref_params), foreach=False, **HYPER)
    ours = TritonAdamW(_groups(our_params), compute_dtype=torch.bfloat16, **HYPER)
    masters = ours.masters()
    assert [masters[p] for p in our_params] and all(p.dtype == torch.bfloat16 for p in our_params)
    for p, q in zip(our_params, ref_params):
        assert masters[p].dtype == torch.float32 and torch.equal(masters[p], q) and torch.equal(p, q.bfloat16())
    for seed, (max_norm, skipped) in enumerate(((1.0, False), (1e3, False), (1.0, True), (0.5, False))):
        _set_grads(ref_params, seed)
        for p, q in zip(our_params, ref_params):
            p.grad = q.grad.bfloat16()  # what the backward of a bf16 weight gives
            q.grad = p.grad.float()
        norm, grad_scale = clip_grad_norm(our_params, max_norm, scale_in_step=True, norm=norm_function(ours))
        before = [masters[p].clone() for p in our_params]
        optimizer_step(ours, grad_scale, found_inf=torch.tensor(float(skipped), device=device))
        if skipped:
            assert all(torch.equal(masters[p], b) for p, b in zip(our_params, before))
            continue
        torch.testing.assert_close(norm, clip_grad_norm(ref_params, max_norm)[0])
        ref.step()
        for p, q in zip(our_params, ref_params):
            torch.testing.assert_close(masters[p], q, rtol=1e-5, atol=1e-6)
            assert torch.equal(p, masters[p].bfloat16())  # the parameter is its master, rounded
            for key in ("exp_avg", "exp_avg_sq"):
                assert ours.state[p][key].dtype == torch.float32
                torch.testing.assert_close(ours.state[p][key], ref.state[q][key], rtol=1e-5, atol=1e-7)
    assert max((masters[p] - q).abs().max().item() for p, q in zip(our_params, _params(device))) > 1e-3
    # a state with masters: the fresh optimizer's parameters follow them; the moments stay fp32
    again_params = _params(device)
    again = TritonAdamW(_groups(again_params), compute_dtype=torch.bfloat16, **HYPER)
    again.load_state_dict(copy.deepcopy(ours.state_dict()))
    for p, q in zip(again_params, our_params):
        assert torch.equal(again.masters()[p], masters[q]) and torch.equal(p, q)
        assert again.state[p]["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(again.state[p]["exp_avg_sq"], ours.state[q]["exp_avg_sq"])
    # torch's state (no masters): the masters stay, the moments come in fp32
    theirs = torch.optim.AdamW(_groups(ref_params), foreach=False, **HYPER)
    theirs.load_state_dict(copy.deepcopy(ref.state_dict()))
    kept = {p: m.clone() for p, m in again.masters().items()}
    again.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for p, q in zip(again_params, ref_params):
        assert torch.equal(again.masters()[p], kept[p])
        assert again.state[p]["exp_avg"].dtype == torch.float32 and torch.equal(again.state[p]["exp_avg"],
                                                                                 ref.state[q]["exp_avg"])


def check_bf16_moments(device: str) -> None:
    """moment_dtype=bf16: the moments are held in bf16 and the step stays torch's fp32 step to bf16 precision; the
    rounding is stochastic, so an update far under half a bf16 step still moves a moment in expectation (round to
    nearest would leave it); a skipped step moves nothing; checkpoints move to and from fp32 moments."""
    ref_params, our_params = _params(device), _params(device)
    ref = torch.optim.AdamW(_groups(ref_params), foreach=False, **HYPER)
    ours = TritonAdamW(_groups(our_params), moment_dtype=torch.bfloat16, **HYPER)
    for seed, skipped in enumerate((False, False, True, False)):
        for params in (ref_params, our_params):
            _set_grads(params, seed)
        before = [p.detach().clone() for p in our_params], {p: ours.state[p]["exp_avg_sq"].clone()
                                                             for p in our_params if ours.state[p]}
        optimizer_step(ours, None, found_inf=torch.tensor(float(skipped), device=device))
        if skipped:
            assert all(torch.equal(p, b) for p, b in zip(our_params, before[0]))
            assert all(torch.equal(ours.state[p]["exp_avg_sq"], v) for p, v in before[1].items())
            continue
        ref.step()
        for p, q in zip(our_params, ref_params):
            torch.testing.assert_close(p, q, rtol=0, atol=2e-4)  # lr 1e-2 times the moments' bf16 error
            for key in ("exp_avg", "exp_avg_sq"):
                assert ours.state[p][key].dtype == torch.bfloat16
                # stochastic rounding errs by up to a bf16 step (2^-7 relative), and a moment near 0 carries the
                # errors of its earlier, larger values
                want = ref.state[q][key]
                torch.testing.assert_close(ours.state[p][key].float(), want, rtol=2 ** -6,
                                           atol=2 ** -5 * want.abs().mean().item())
    # v = 154/256 (exact in bf16, whose step there is 2^-8), g = 1, beta2 = 0.999: each step adds 4e-4 to v in fp32
    p = torch.nn.Parameter(torch.zeros(4096, device=device))
    opt = TritonAdamW([p], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, moment_dtype=torch.bfloat16)
    opt.state[p].update(step=torch.zeros((), device=device), exp_avg=torch.zeros_like(p, dtype=torch.bfloat16),
                        exp_avg_sq=torch.full_like(p, 154 / 256, dtype=torch.bfloat16))
    v_ref = 154 / 256
    for _ in range(20):
        p.grad = torch.ones_like(p)
        opt.step()
        v_ref = 0.999 * v_ref + 0.001
    v = opt.state[p]["exp_avg_sq"].float()
    assert abs(v.mean().item() - v_ref) < 1e-3 < v_ref - 154 / 256, (v.mean().item(), v_ref)
    assert v.unique().numel() > 1  # rounded up here, down there
    # checkpoints: bf16 moments into fp32 ones (this and torch's implementation) and back
    fp32 = TritonAdamW(_groups([torch.nn.Parameter(p.detach().clone()) for p in our_params]), **HYPER)
    fp32.load_state_dict(copy.deepcopy(ours.state_dict()))
    back = TritonAdamW(_groups([torch.nn.Parameter(p.detach().clone()) for p in our_params]),
                       moment_dtype=torch.bfloat16, **HYPER)
    back.load_state_dict(copy.deepcopy(fp32.state_dict()))
    for a, b, c in zip(our_params, fp32._params(), back._params()):
        assert fp32.state[b]["exp_avg"].dtype == torch.float32 and back.state[c]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(fp32.state[b]["exp_avg"], ours.state[a]["exp_avg"].float())
        assert torch.equal(back.state[c]["exp_avg_sq"], ours.state[a]["exp_avg_sq"])
    # with fp32 masters (one GPU's bf16 weights) the moments are bf16 from the start
    both = TritonAdamW(_groups(_params(device)), compute_dtype=torch.bfloat16, moment_dtype=torch.bfloat16, **HYPER)
    assert all(state["exp_avg"].dtype == torch.bfloat16 and state["master"].dtype == torch.float32
               for state in both.state.values())


def check_no_masters(device: str) -> None:
    """keep_masters=False (optim.master_weights=none): bf16 parameters take torch's fp32 step to bf16 precision with
    no master kept; the rounding is stochastic, so updates far under half a bf16 step of the weight still move it in
    expectation (round to nearest would leave it), with other bits than the moments'; a skipped step moves nothing;
    a state with masters loads into it as the weights, rounded, and no master."""
    ref_params, our_params = _params(device), _params(device)
    for p, q in zip(our_params, ref_params):
        q.data = q.data.bfloat16().float()  # the same start on the bf16 grid
    ref = torch.optim.AdamW(_groups(ref_params), foreach=False, **HYPER)
    ours = TritonAdamW(_groups(our_params), compute_dtype=torch.bfloat16, keep_masters=False, **HYPER)
    assert ours.masters() == {} and all(p.dtype == torch.bfloat16 for p in our_params)
    assert all(torch.equal(w, p.float()) for p, w in ours.fp32_weights().items()) and len(ours.fp32_weights()) == 4
    for seed, skipped in enumerate((False, False, True, False)):
        _set_grads(ref_params, seed)
        for p, q in zip(our_params, ref_params):
            p.grad = q.grad.bfloat16()
            q.grad = p.grad.float()
        before = [p.detach().clone() for p in our_params]
        optimizer_step(ours, None, found_inf=torch.tensor(float(skipped), device=device))
        if skipped:
            assert all(torch.equal(p, b) for p, b in zip(our_params, before))
            continue
        ref.step()
        for p, q in zip(our_params, ref_params):
            assert p.dtype == torch.bfloat16 and "master" not in ours.state[p]
            # each step rounds up or down by under a bf16 step (2^-7 of the value then, within a few lr of now),
            # three steps so far
            bound = 3 * 2 ** -7 * (q.abs() + 3 * HYPER["lr"])
            assert ((p.float() - q).abs() <= bound).all(), ((p.float() - q).abs() / bound).max()
            torch.testing.assert_close(ours.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-5, atol=1e-7)
    # p = 1 (bf16 step 2^-7 there), g = 1: each step takes lr = 1e-4 off, an eightieth of a bf16 step
    p = torch.nn.Parameter(torch.ones(4096, device=device))
    for moments in (None, torch.bfloat16):
        p.data = torch.ones(4096, device=device)
        opt = TritonAdamW([p], lr=1e-4, weight_decay=0.0, compute_dtype=torch.bfloat16, keep_masters=False,
                          moment_dtype=moments)
        for _ in range(50):
            p.grad = torch.ones_like(p)
            opt.step()
        # in expectation 1 - 50e-4, 1.3 bf16 steps (2^-8 under 1) down; round to nearest stays at 1
        assert abs(p.float().mean().item() - (1 - 50e-4)) < 1e-3 and p.unique().numel() > 1, p.float().mean()
        if moments is not None:  # the parameter's bits are not the moments': where one rounds, the other need not
            v = opt.state[p]["exp_avg_sq"]
            assert not torch.equal((p < 1).int(), (v != v.max()).int())
    # a state with masters: the weights follow them, rounded to nearest; the moments stay fp32; no master is kept
    with_masters = TritonAdamW(_groups(_params(device)), compute_dtype=torch.bfloat16, **HYPER)
    for master in with_masters.masters().values():
        master.add_(1e-3)
    again_params = _params(device)
    again = TritonAdamW(_groups(again_params), compute_dtype=torch.bfloat16, keep_masters=False, **HYPER)
    again.load_state_dict(copy.deepcopy(with_masters.state_dict()))
    for p, q in zip(again_params, with_masters._params()):
        assert torch.equal(p, with_masters.masters()[q].bfloat16()) and "master" not in again.state[p]
        assert again.state[p]["exp_avg"].dtype == torch.float32


def check_sum_squares(device: str) -> None:
    """TritonAdamW's norm (`sum_squares`, one launch per dtype) is torch's: over sizes that do and do not fill its
    blocks, an empty tensor, one not 16-byte aligned, bf16 and fp32 together; kept block tables follow new sizes."""
    g = torch.Generator().manual_seed(3)
    block = kernel.NORM_BLOCK
    buffer = torch.randn(block + 9, generator=g)
    tensors = [torch.randn(s, generator=g) * 10 for s in ((block,), (2 * block + 5,), (0,), (7, 3), (block - 1,))]
    tensors = [t.to(device) for t in tensors] + [buffer.to(device)[1:block + 3]]  # 4 bytes past a 16-byte boundary
    mixed = tensors[:3] + [t.bfloat16() for t in tensors[3:]]
    params = [torch.nn.Parameter(torch.zeros(1, device=device))]
    opt = TritonAdamW(params, **HYPER)
    assert norm_function(opt) == opt.global_norm and norm_function(torch.optim.AdamW(params)) is global_norm
    opt.triton_norm = False  # optim.grad_norm=torch (apply_config sets it)
    assert norm_function(opt) is global_norm
    opt.triton_norm = True
    for case in (tensors, mixed, tensors[:2]):  # the last: new sizes, a new table
        expect = torch.cat([t.double().flatten() for t in case]).norm()
        got = opt.global_norm(case)
        assert got.dtype == torch.float32 and got.device.type == torch.device(device).type
        torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=0)
        torch.testing.assert_close(got, global_norm(case), rtol=1e-5, atol=0)
    assert len([k for k in opt._blocks if k[0] == "norm"]) == 2  # one per dtype
    partials = kernel.sum_squares([tensors[1]])
    torch.testing.assert_close(partials.double(), tensors[1].double().square().sum(), rtol=1e-5, atol=0)


def _interpreter_main() -> None:
    from tests.helpers import patch_triton_interpreter

    patch_triton_interpreter()
    check("cpu")
    check_masters("cpu")
    check_bf16_moments("cpu")
    check_no_masters("cpu")
    check_sum_squares("cpu")
    print("adamw interpreter ok")


def test_triton_adamw_takes_torchs_step_in_the_interpreter():
    run_in_triton_interpreter("import tests.train.test_triton_adamw as t; t._interpreter_main()", "adamw interpreter ok")


@pytest.mark.gpu
def test_triton_adamw_takes_torchs_step_on_the_gpu():
    check("cuda")
    check_masters("cuda")
    check_bf16_moments("cuda")
    check_no_masters("cuda")
    check_sum_squares("cuda")


def test_only_triton_keeps_bf16_moments():
    with pytest.raises(ValueError, match="moment_dtype=bf16 needs optim.implementation=triton.*=fp32 or auto"):
        build_optimizer(_model(), OptimConfig(moment_dtype="bf16"))
    with pytest.raises(ValueError, match="optim.moment_dtype='fp16' is not one of auto, fp32, bf16"):
        OptimConfig(moment_dtype="fp16")


def test_only_triton_takes_the_triton_norm():
    with pytest.raises(ValueError, match="grad_norm=triton is triton's AdamW's.*fused here: set optim.grad_norm=torch"):
        build_optimizer(_model(), OptimConfig(grad_norm="triton"))
    with pytest.raises(ValueError, match="optim.grad_norm='fp32' is not one of auto, torch, triton"):
        OptimConfig(grad_norm="fp32")
    assert norm_function(build_optimizer(_model(), OptimConfig(grad_norm="torch"))) is global_norm


def test_only_triton_keeps_master_weights():
    with pytest.raises(ValueError, match="implementation=fused keeps no fp32 master weights.*param_dtype=fp32"):
        build_optimizer(_model(), OptimConfig(implementation="fused"), compute_dtype=torch.bfloat16)


def _model(device: str = "cpu") -> Transformer:
    cfg = ModelConfig(vocab_size=32, dim=16, num_layers=1, num_heads=2,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_dim=8, kernel_backend="reference"))
    model = Transformer(cfg).to(device)
    model.init_weights(seed=0)
    return model


def test_triton_adamw_refuses_cpu_parameters():
    with pytest.raises(ValueError, match="triton runs on CUDA GPUs; the parameters are on cpu.*implementation=fused"):
        build_optimizer(_model(), OptimConfig(implementation="triton"))


def test_torchs_fused_adamw_takes_the_clip_as_a_divisor():
    """The trainer hands fused AdamW the clip as `grad_scale` instead of scaling every gradient in place first
    (the moments show the clipped gradient: AdamW's update alone hardly depends on a gradient's scale)."""
    after = {}
    for in_step in (False, True):
        model = _model()
        opt = build_optimizer(model, OptimConfig(implementation="fused"))
        for seed in range(2):
            tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(seed))
            out = model(tokens)
            (out.logits_BSV.square().mean() + out.router_loss).backward()
            norm, grad_scale = clip_grad_norm(model.parameters(), 0.01, scale_in_step=in_step)
            assert (grad_scale is not None) == in_step and norm > 0.01  # it clips
            optimizer_step(opt, grad_scale)
            opt.zero_grad()
        after[in_step] = [torch.cat([p.detach().flatten() for p in model.parameters()]),
                          torch.cat([opt.state[p]["exp_avg"].flatten() for p in model.parameters()])]
    for a, b in zip(after[True], after[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert clip_grad_norm(_model().parameters(), float("inf"), scale_in_step=True)[1] is None  # no clip, no divisor


def _moment_dtypes(optimizer) -> set[torch.dtype]:
    return {state[key].dtype for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")}


def test_auto_is_torchs_fused_adamw_with_fp32_moments_on_the_cpu():
    model = _model()
    optimizer = build_optimizer(model, OptimConfig())
    assert (OptimConfig().implementation, OptimConfig().moment_dtype) == ("auto", "auto")
    assert type(optimizer) is torch.optim.AdamW
    assert all(group["fused"] for group in optimizer.param_groups) and takes_grad_scale(optimizer)
    model(torch.zeros(1, 4, dtype=torch.long)).logits_BSV.sum().backward()
    optimizer.step()
    assert _moment_dtypes(optimizer) == {torch.float32}


@pytest.mark.gpu
def test_auto_is_triton_with_bf16_moments_on_cuda():
    """optim.moment_dtype=auto holds triton's moments in bf16 (docs/performance.md has the loss curves); fp32 stays
    one override away. optim.grad_norm=auto takes triton's norm with it; torch's is one override away."""
    for moment_dtype, want in (("auto", torch.bfloat16), ("fp32", torch.float32)):
        model = _model("cuda")
        optimizer = build_optimizer(model, OptimConfig(moment_dtype=moment_dtype))
        assert isinstance(optimizer, TritonAdamW)
        model(torch.zeros(1, 4, dtype=torch.long, device="cuda")).logits_BSV.sum().backward()
        optimizer.step()
        assert _moment_dtypes(optimizer) == {want}, moment_dtype
        assert norm_function(optimizer) == optimizer.global_norm  # optim.grad_norm=auto: triton's with it
    torch_norm = build_optimizer(_model("cuda"), OptimConfig(grad_norm="torch"))
    assert isinstance(torch_norm, TritonAdamW) and norm_function(torch_norm) is global_norm


def _sm90_ptx(bf16_moments: bool) -> str:
    """The step kernel's PTX for sm_90a (bf16 weights, fp32 masters, the clip and the skip)."""
    moment = "*bf16" if bf16_moments else "*fp32"
    pointers = {"table_ptr": "*i64", "blocks_ptr": "*i32", "p_like": "*bf16", "master_like": "*fp32",
                "g_like": "*bf16", "m_like": moment, "step_like": "*fp32", "scale_ptr": "*fp32", "skip_ptr": "*fp32"}
    floats = dict.fromkeys(("lr", "weight_decay", "beta1", "beta2", "log2_beta1", "log2_beta2", "eps"), "fp32")
    flags = {"HAS_MASTER": True, "HAS_SCALE": True, "HAS_SKIP": True, "BF16_MOMENTS": bf16_moments, "ALIGNED": True,
             "BLOCK": kernel.BLOCK}
    return _compile_sm90(kernel._adamw_kernel, {**pointers, **floats}, flags)


def _compile_sm90(fn, signature: dict, constexprs: dict) -> str:
    """`fn`'s PTX for sm_90a, compiled ahead of time on any machine with Triton's ptxas."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": kernel.WARPS}).asm["ptx"]
    except Exception as err:  # noqa: BLE001 (a Triton without its CUDA toolchain)
        pytest.skip(f"cannot compile for sm_90a here: {err}")


@pytest.mark.gpu  # needs Triton's CUDA toolchain: CI skips it, the smoke (-m gpu) runs it
@pytest.mark.parametrize("bf16_moments", [False, True])
def test_full_blocks_load_and_store_16_bytes_at_a_time(bf16_moments):
    """The kernel reads its addresses from a table, where the compiler cannot see their alignment or the tensors'
    sizes: without the alignment hint and the unmasked full-block path it issues 2- and 4-byte accesses and the step
    runs ~1.5x longer (measured on an H200)."""
    import re

    ptx = _sm90_ptx(bf16_moments)
    # a thread's 8 elements of a full block, in 16-byte accesses: 1 of bf16, 2 of fp32
    moments = 2 * (1 if bf16_moments else 2)
    loads, stores = 1 + 2 + moments, 2 + 1 + moments  # gradient, master, moments in; master, parameter, moments out
    assert len(re.findall(r"\bld\.global\.v4\.b32", ptx)) == loads
    assert len(re.findall(r"\bst\.global\.v4\.b32", ptx)) == stores


@pytest.mark.gpu  # needs Triton's CUDA toolchain: CI skips it, the smoke (-m gpu) runs it
def test_norm_full_blocks_load_16_bytes_at_a_time():
    """The gradient norm's kernel reads its addresses from a table too: a thread's 32 bf16 elements of a full block
    in four 16-byte loads (without the hint and the unmasked path: 2-byte loads)."""
    import re

    ptx = _compile_sm90(kernel._sum_squares_kernel,
                        {"table_ptr": "*i64", "blocks_ptr": "*i32", "like": "*bf16", "out_ptr": "*fp32"},
                        {"ALIGNED": True, "BLOCK": kernel.NORM_BLOCK})
    assert kernel.NORM_BLOCK // (32 * kernel.WARPS) == 32
    assert len(re.findall(r"\bld\.global\.v4\.b32", ptx)) >= 4


@pytest.mark.gpu  # needs Triton's CUDA toolchain: CI skips it, the smoke (-m gpu) runs it
def test_bf16_moments_random_bits_cost_a_few_instructions():
    """Stochastic rounding's bits are a cheap hash: Philox (tl.randint4x, ~100 integer instructions an element, its
    32x32->64-bit products `mul.hi`) made the bf16-moment step compute-bound, no faster than fp32 moments' (H200).
    Now the kernel is under 2x the fp32-moment kernel's PTX (Philox's was 3.4x)."""
    import re

    def instructions(ptx: str) -> int:
        return sum(1 for line in ptx.splitlines() if re.match(r"\s+(@%p\d+\s+)?[a-z]", line))

    bf16, fp32 = _sm90_ptx(True), _sm90_ptx(False)
    assert "mul.hi" not in bf16
    assert instructions(bf16) < 2 * instructions(fp32), (instructions(bf16), instructions(fp32))
