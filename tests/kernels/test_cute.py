"""CuTe-DSL Hopper backend: every kernel against an fp32 reference, then the whole layer.

GPU tests need an sm_90 GPU and nvidia-cutlass-dsl; they skip cleanly otherwise. The CPU
tests check that the backend stays importable and explains itself where it cannot run.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sonic.kernels import reference, resolve_backend
from sonic.kernels.swiglu import dswiglu, swiglu
from sonic.routing.plan import plan_from_topk
from tests.helpers import padded_plan_from_topk

# --------------------------------------------------------------------------- CPU
def test_import_does_not_load_cutlass():
    code = ("import sys, torch, sonic.kernels.cute as c; "
            "assert 'cutlass' not in sys.modules; print(c.unavailable_reason(torch.device('cpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "CUDA" in out.stdout


def test_explicit_request_names_the_reason_on_cpu():
    with pytest.raises(ValueError, match="cute.*CUDA"):
        resolve_backend("cute", torch.device("cpu"))


def test_cpu_tensors_get_a_clear_error_without_cutlass():
    from sonic.kernels import cute

    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    plan = plan_from_topk(torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1), 2)
    with pytest.raises(ValueError, match="cute backend needs CUDA tensors.*kernel_backend=reference"):
        cute.experts(x, torch.zeros(2, 16, 8, dtype=torch.bfloat16), torch.zeros(2, 8, 8, dtype=torch.bfloat16), plan)


# --------------------------------------------------------------------------- GPU helpers
def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    from sonic.kernels import cute
    return cute.unavailable_reason(torch.device("cuda"))


needs_cute = pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))


def _dsl_reason() -> str | None:
    from sonic.kernels import cute
    return cute._cutlass_reason()


# the DSL alone (no GPU): config parsing, the defaults' checks, and whole compiles to a cubin
needs_dsl = pytest.mark.skipif(_dsl_reason() is not None, reason=f"{_dsl_reason()}; pip install -e '.[dev]' has it")
gpu = [pytest.mark.gpu, needs_cute]

BF16_TOL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poisoned(*shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def make_plan(T: int, E: int, K: int, routing: str, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, device="cuda", generator=g)
    if routing == "skewed":  # most rows land on experts 0 and 1
        logits[:, :2] += 4.0
    elif routing == "empty":  # only a third of the experts receive rows
        logits[:, torch.arange(E, device="cuda") % 3 != 0] = -1e4
    top, idx = logits.topk(K, dim=-1)
    if routing == "padded":  # the top-K rows padded as token rounding pads them (sonic/routing/plan.py)
        return padded_plan_from_topk(idx, torch.softmax(top, -1), E, extra=150)
    return plan_from_topk(idx, torch.softmax(top, -1), E)


def segments(plan):
    off = plan.expert_offsets_E1.tolist()
    return [(e, off[e], off[e + 1]) for e in range(len(off) - 1)]


ROUTINGS = ["uniform", "skewed", "empty"]
# (T, D, N, E, K): rows per expert are not multiples of the 128-row tile; the first shape
# has partial n-tiles (N=192 with 128-wide dH tiles) and several k-tiles.
SHAPES = [(300, 384, 192, 8, 2), (517, 512, 256, 6, 3)]


def inputs(T, D, N, E, seed):
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, 2 * N, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, D, N, device="cuda", generator=g) / N ** 0.5).bfloat16()
    return x, w1, w2


# --------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.gpu
@needs_cute
def test_up_and_down_proj(shape, routing):
    check_up_and_down_proj(shape, routing, cfgs={})


def check_up_and_down_proj(shape, routing, cfgs):
    from sonic.kernels.cute import ops
    T, D, N, E, K = shape
    plan = make_plan(T, E, K, routing, seed=T + E)
    x, w1, w2 = inputs(T, D, N, E, seed=7)
    R = plan.num_rows
    h, a = ops.up_proj(x, w1, plan.token_idx_R, plan.expert_offsets_E1, cfg=cfgs.get("up"),
                       out=(poisoned(R, 2 * N), poisoned(R, N)))
    y = ops.down_proj(a, w2, plan.expert_offsets_E1, plan.token_idx_R, cfg=cfgs.get("down"), out=poisoned(R, D))
    tok = plan.token_idx_R.long()
    h_ref = torch.empty(R, 2 * N, device="cuda")
    y_ref = torch.empty(R, D, device="cuda")
    for e, lo, hi in segments(plan):
        h_ref[lo:hi] = x[tok[lo:hi]].float() @ w1[e].float().T
        y_ref[lo:hi] = a[lo:hi].float() @ w2[e].float().T  # down-proj checked on its own input
    assert rel_err(h, h_ref) < BF16_TOL
    assert rel_err(a, swiglu(h_ref)) < BF16_TOL
    assert rel_err(y, y_ref) < BF16_TOL


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.gpu
@needs_cute
def test_dh_dx_dw(shape, routing):
    check_dh_dx_dw(shape, routing, cfgs={})


def check_dh_dx_dw(shape, routing, cfgs):
    from sonic.kernels.cute import ops
    T, D, N, E, K = shape
    plan = make_plan(T, E, K, routing, seed=3 * T + E)
    x, w1, w2 = inputs(T, D, N, E, seed=11)
    R = plan.num_rows
    g = torch.Generator(device="cuda").manual_seed(5)
    dout = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    h = torch.randn(R, 2 * N, device="cuda", generator=g).bfloat16()
    s = plan.scores_R.float()
    n_tiles = -(-N // ops.dh_tile_n(D, N, cfgs.get("dh")))
    dh, ap, ds = ops.dh(dout, w2, h, s, plan.token_idx_R, plan.expert_offsets_E1, cfg=cfgs.get("dh"),
                        out=(poisoned(R, 2 * N), poisoned(R, N),
                             poisoned(n_tiles, R, dtype=torch.float32)))
    dxt = ops.dx_rows(dh, w1, plan.expert_offsets_E1, plan.token_idx_R, cfg=cfgs.get("dx"), out=poisoned(R, D))
    dw1 = ops.dw1(dh, x, plan.token_idx_R, plan.expert_offsets_E1, E, cfg=cfgs.get("dw1"),
                  out=poisoned(E, 2 * N, D))
    dw2 = ops.dw2(dout, ap, plan.token_idx_R, plan.expert_offsets_E1, E, cfg=cfgs.get("dw2"),
                  out=poisoned(E, D, N))

    tok = plan.token_idx_R.long()
    da_prime = torch.empty(R, N, device="cuda")
    dxt_ref = torch.empty(R, D, device="cuda")
    dw1_ref = torch.zeros(E, 2 * N, D, device="cuda")
    dw2_ref = torch.zeros(E, D, N, device="cuda")
    for e, lo, hi in segments(plan):
        da_prime[lo:hi] = dout[tok[lo:hi]].float() @ w2[e].float()
        dxt_ref[lo:hi] = dh[lo:hi].float() @ w1[e].float()  # each GEMM on its own inputs
        dw1_ref[e] = dh[lo:hi].float().T @ x[tok[lo:hi]].float()
        dw2_ref[e] = dout[tok[lo:hi]].float().T @ ap[lo:hi].float()
    a = swiglu(h)
    assert rel_err(ds, (da_prime * a).sum(-1)) < BF16_TOL
    assert rel_err(dh, dswiglu(s[:, None] * da_prime, h)) < BF16_TOL
    assert rel_err(ap, s[:, None] * a) < BF16_TOL
    assert rel_err(dxt, dxt_ref) < BF16_TOL
    assert rel_err(dw1, dw1_ref) < BF16_TOL
    assert rel_err(dw2, dw2_ref) < BF16_TOL
    if routing == "empty":  # experts without rows get exact zeros
        empty = (plan.counts_E() == 0).nonzero().flatten()
        assert (dw1[empty] == 0).all() and (dw2[empty] == 0).all()


# Tile configurations beyond the ones the tests above run by default (pp192c2 for down and dx at these shapes),
# on every kernel each applies to: partial n-tiles (d = 384 and 512, N = 192 against 128-, 192- and 256-wide
# tiles; with a cluster, an odd n-tile count padded to even), rows per expert that are not multiples of the
# 128-row tile, experts without rows. Each config compiles its kernels (seconds each), so the list stays short:
# 256-wide cooperative tiles in a cluster (co256c2), 192-wide tiles without a cluster, a padded cluster (pp128c2, the
# long-reduction default), and 256-row tiles (down, dx, dw1; a partial last m-tile of dW1 at 2N = 384) alone and in a
# cluster; widths that are not multiples of 64, whose epilogue runs an odd count of sub-tiles (pp160c2: five of 32
# columns on down and dx; pp176: eleven of 16 on every kernel but dW1); and pp192c2, the short-reduction default of
# down and dX~, which the default path no longer takes at these shapes (few rows per expert: ops.FEW_ROWS).
TILE_CONFIGS = ["pp192", "co256c2", "pp128c2", "co128m256", "co128m256c2", "pp160c2", "pp176", "pp192c2"]


@pytest.mark.parametrize("cfg", TILE_CONFIGS)
@pytest.mark.gpu
@needs_cute
def test_every_tile_config(cfg):
    from sonic.kernels.cute import ops

    def fits(kind):
        try:
            ops.check_config(kind, ops.Config.parse(cfg))
            return True
        except ValueError:
            return False

    cfgs = {k: cfg for k in ("up", "down", "dh", "dx", "dw1", "dw2") if fits(k)}
    for shape, routing in ((SHAPES[0], "skewed"), (SHAPES[1], "uniform"), (SHAPES[1], "empty")):
        check_up_and_down_proj(shape, routing, cfgs)
        check_dh_dx_dw(shape, routing, cfgs)


KINDS = ("up", "down", "dh", "dx", "dw1", "dw2")


@needs_dsl
@pytest.mark.parametrize("kind", KINDS)
def test_every_kernel_compiles_without_a_gpu(kind, monkeypatch):
    """Each kernel through the DSL's whole compile (trace, MLIR, PTX, cubin for sm_90a) on the CPU: the default
    config staged and direct, the default at few rows per expert, every config of test_every_tile_config that fits,
    and fp16, at a shape whose widths take the 256-wide tiles and at one that falls back to 128. The DSL's
    trace-time errors (a dynamic loop carrying a Python list, range_constexpr outside a jit function, a type that
    changes across a branch) then fail here, in CI, instead of in a device call."""
    from dataclasses import replace

    from sonic.kernels.cute import ops
    monkeypatch.setenv("SONIC_CUTE_CACHE_DIR", "off")  # compile for real; write nothing
    jobs = set()
    for (D, N, E), configs in (((4096, 512, 16), TILE_CONFIGS), ((768, 192, 8), ())):
        default, few_rows = ops.default_config(kind, D, N), ops.default_config(kind, D, N, ops.FEW_ROWS)
        for cfg in (default, replace(default, staged=True), few_rows, *map(ops.Config.parse, configs)):
            try:
                ops.check_config(kind, cfg)
            except ValueError:
                continue
            jobs.add((torch.bfloat16, D, N, E, cfg))
    jobs.add((torch.float16, 4096, 512, 16, ops.default_config(kind, 4096, 512)))
    for dtype, D, N, E, cfg in sorted(jobs, key=str):
        ops._compiled(kind, dtype, D, N, E, cfg, 132)  # raises on any compile error


@needs_dsl
@pytest.mark.parametrize("weighted", [True, False])
def test_gather_sum_compiles_without_a_gpu(weighted, monkeypatch):
    from sonic.kernels.cute import ops
    from sonic.kernels.cute.aggregate import default_max_per_lane
    monkeypatch.setenv("SONIC_CUTE_CACHE_DIR", "off")
    for dtype, D in ((torch.bfloat16, 4096), (torch.bfloat16, 776), (torch.float16, 1536)):
        ops._compiled_gather_sum(dtype, D, weighted, default_max_per_lane(D, weighted))


@pytest.mark.gpu
@needs_cute
def test_direct_and_staged_stores_write_the_same_bits():
    """Every kernel with a register-direct store (up, down, dH, dX~, dW1, dW2 at their default configs) against the
    same config staged ("s"), partial tiles and experts without rows included: bit for bit, every output written (dH's
    dS partials too)."""
    from sonic.kernels.cute import ops
    T, D, N, E, K = SHAPES[1]
    plan = make_plan(T, E, K, "empty", seed=5)
    x, w1, w2 = inputs(T, D, N, E, seed=13)
    R = plan.num_rows
    tok, off = plan.token_idx_R, plan.expert_offsets_E1
    g = torch.Generator(device="cuda").manual_seed(9)
    dh = torch.randn(R, 2 * N, device="cuda", generator=g).bfloat16()
    act = torch.randn(R, N, device="cuda", generator=g).bfloat16()
    dout = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    h = torch.randn(R, 2 * N, device="cuda", generator=g).bfloat16()
    s = torch.rand(R, device="cuda", generator=g)
    n_tiles = -(-N // ops.dh_tile_n(D, N))

    def run(suffix):
        cfg = {k: str(ops.default_config(k, D, N)) + suffix for k in ("up", "down", "dh", "dx", "dw1", "dw2")}
        ds_out = torch.full((n_tiles, R), float("nan"), device="cuda")
        return (*ops.up_proj(x, w1, tok, off, cfg=cfg["up"], out=(poisoned(R, 2 * N), poisoned(R, N))),
                ops.down_proj(act, w2, off, tok, cfg=cfg["down"], out=poisoned(R, D)),
                *ops.dh(dout, w2, h, s, tok, off, cfg=cfg["dh"], out=(poisoned(R, 2 * N), poisoned(R, N), ds_out)),
                ops.dx_rows(dh, w1, off, tok, cfg=cfg["dx"], out=poisoned(R, D)),
                ops.dw1(dh, x, tok, off, E, cfg=cfg["dw1"], out=poisoned(E, 2 * N, D)),
                ops.dw2(dout, act, tok, off, E, cfg=cfg["dw2"], out=poisoned(E, D, N)))

    for name, direct, staged in zip(("H", "A", "Y", "dH", "A'", "dS", "dX~", "dW1", "dW2"), run(""), run("s")):
        assert torch.equal(direct, staged), name  # NaN (an unwritten element) never equals itself


@needs_dsl
def test_config_strings_round_trip():
    from sonic.kernels.cute import ops
    for text in ("co256", "pp128", "pp192c2", "co128m256c2", "pp176", "pp192c2s", "co128m256s"):
        assert str(ops.Config.parse(text)) == text
    assert ops.Config.parse("pp192c2s").staged and not ops.Config.parse("pp192c2").staged
    with pytest.raises(ValueError, match="s \\(a staged store\\)"):
        ops.Config.parse("pp192x")


@needs_dsl
def test_every_default_config_fits_its_kernel_on_every_benchmarked_shape():
    """The defaults chosen by shape (ops.default_config) pass ops.check_config on every Table 9b and real-model
    shape, so no shape a user benchmarks or trains meets a refusal from a default (nothing compiles here)."""
    from bench.moe_configs import CONFIGS
    from sonic.kernels.cute import ops

    for name, (T, D, N, E, K) in CONFIGS.items():
        for kind in ("up", "down", "dh", "dx", "dw1", "dw2"):
            cfg = ops.default_config(kind, D, N, T * K // E)  # the launchers pass their routed rows
            assert cfg == ops.default_config(kind, D, N), (name, kind)  # no Table 9b config has few rows per expert
            ops.check_config(kind, cfg)
            short = kind in ops.SHORT_K and ops.reduction(kind, D, N) <= ops.SHORT_K[kind]
            if kind in ("down", "dx"):  # ping-pong CTA pairs, 192 wide over a short reduction, 128 over a long one
                assert cfg.pingpong and cfg.cluster == 2, (name, kind, cfg)
                assert cfg.tile_n == (192 if short else 128), (name, kind)
            if kind == "up":  # ping-pong 128-wide tiles over a short reduction (d), cooperative beyond
                assert (cfg.pingpong, cfg.tile_n) == ((True, 128) if short else (False, 256)), (name, kind, cfg)


@needs_dsl
def test_few_rows_per_expert_take_their_own_down_and_dx_configs():
    """At most ops.FEW_ROWS routed rows per expert (the token-rounding sweep's shapes), down and dX~ take the configs
    measured there, at short and long reductions alike; above it, and for the other kernels, the row count changes
    nothing; every one of them is a config its kernel can run."""
    from sonic.kernels.cute import ops

    for D, N in ((4096, 512), (4096, 1024), (1536, 256)):
        for rows in (128, ops.FEW_ROWS):
            for kind in ("up", "down", "dh", "dx", "dw1", "dw2"):
                cfg = ops.default_config(kind, D, N, rows)
                ops.check_config(kind, cfg)
                want = ops.FEW_ROWS_DEFAULTS.get(kind)
                assert str(cfg) == want if want else cfg == ops.default_config(kind, D, N), (D, N, rows, kind)
        for kind in ("down", "dx"):
            assert ops.default_config(kind, D, N, ops.FEW_ROWS + 1) == ops.default_config(kind, D, N)


@needs_dsl
def test_default_config_cache_holds_one_entry_per_few_rows_class_not_per_row_count():
    """The launchers pass their routed-row count at every call, and under token rounding it changes every step: the
    cached lookup keeps two answers per shape (few rows or not), however many distinct counts it has seen."""
    from sonic.kernels.cute import ops

    ops.tile_config.cache_clear()
    seen = {ops.default_config("down", 4096, 512, rows) for rows in range(1, 4 * ops.FEW_ROWS, 7)}
    assert seen == {ops.default_config("down", 4096, 512, 1), ops.default_config("down", 4096, 512)}
    assert ops.tile_config.cache_info().currsize == 2


@pytest.mark.gpu
@needs_cute
def test_configs_a_kernel_cannot_run_are_refused():
    from sonic.kernels.cute import ops
    for kind, cfg, why in (("up", "co256c2", "only down and dx"), ("dw1", "co192", "power of two"),
                           ("down", "pp256", "192 columns at most"), ("dx", "co88", "multiple of 16"),
                           ("down", "co48", "from 64 to 256"),
                           ("up", "co128m256", "only down, dx, dw1"), ("dw1", "co256m256", "at most 128 wide"),
                           ("dx", "pp128m256", "cooperative")):
        with pytest.raises(ValueError, match=why):
            ops.compiled(kind, torch.bfloat16, 512, 256, 8, cfg)


# d = 264, 33 chunks of 8: one column slice of 2 chunks per lane. d = 2056, 257 chunks: the defaults (weighted:
# three slices of 3 chunks per lane, the last one partial; unweighted: five slices of 2, the last holding one chunk),
# and whole rows (one slice of 9 chunks per lane)
@pytest.mark.parametrize("D,max_per_lane", [(264, None), (2056, None), (2056, 16)])
@pytest.mark.gpu
@needs_cute
def test_gather_sum(D, max_per_lane):
    from sonic.kernels.cute import ops
    plan = make_plan(1000, 16, 4, "skewed", seed=1)
    rows = torch.randn(plan.num_rows, D, device="cuda").bfloat16()
    for w in (plan.scores_R, None):
        out = ops.gather_sum(rows, plan.token_offsets_T1, plan.rows_by_token_R, w,
                             out=poisoned(plan.num_tokens, D), max_per_lane=max_per_lane)
        ref = reference.gather_sum(rows, plan, w)
        assert rel_err(out, ref) < 2e-3


# every lane's chunks in the row (d = 512: one slice of 2 per lane), and not (d = 264); tokens with no rows, one, a
# warp's worth (32) and more, whose row indices the kernel takes 32 at a time
@pytest.mark.parametrize("D", [512, 264])
@pytest.mark.gpu
@needs_cute
def test_gather_sum_of_any_rows_per_token(D):
    from sonic.kernels.cute import ops
    gen = torch.Generator().manual_seed(D)
    counts = torch.tensor([0, 1, 31, 32, 33, 64, 70, 0, 8, 5] * 5)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).int().cuda()
    R = int(counts.sum())
    rows_by_token = torch.randperm(R, generator=gen).int().cuda()
    rows = torch.randn(R, D, generator=gen).bfloat16().cuda()
    scores = torch.rand(R, generator=gen).cuda()
    token = torch.repeat_interleave(torch.arange(len(counts)), counts).cuda()
    for w in (scores, None):
        out = ops.gather_sum(rows, offsets, rows_by_token, w, out=poisoned(len(counts), D))
        picked = rows[rows_by_token.long()].float() * (1 if w is None else w[rows_by_token.long()][:, None])
        ref = torch.zeros(len(counts), D, device="cuda").index_add_(0, token, picked)
        assert rel_err(out, ref) < 2e-3 and out[counts.cuda() == 0].abs().max() == 0


# --------------------------------------------------------------------------- the layer
def _layer(backend, x, w1, w2, plan, dout):
    from sonic.kernels import experts
    x, w1, w2 = (t.detach().clone().requires_grad_() for t in (x, w1, w2))
    scores = plan.scores_R.detach().clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = experts(x, w1, w2, plan.with_scores(scores), backend=backend)
    out.backward(dout.to(out.dtype))
    return out, x.grad, w1.grad, w2.grad, scores.grad, sum(saved)


@pytest.mark.parametrize("routing", ROUTINGS + ["padded"])
@pytest.mark.gpu
@needs_cute
def test_layer_forward_backward(routing, monkeypatch):
    """The whole layer against the fp32 reference, the backward's buffers poisoned (NaN): a padded plan's
    padding rows must neither reach a gradient nor leave NaN in one."""
    from sonic.kernels.cute import function
    from tests.conftest import poisoned_empty

    monkeypatch.setattr(function, "_alloc", poisoned_empty)
    T, D, N, E, K = 640, 256, 128, 8, 2
    plan = make_plan(T, E, K, routing, seed=21)
    x, w1, w2 = inputs(T, D, N, E, seed=4)
    dout = torch.randn(T, D, device="cuda").bfloat16()
    got = _layer("cute", x, w1, w2, plan, dout)
    ref = _layer("reference", x.float(), w1.float(), w2.float(), plan, dout.float())
    for name, g, r in zip(("O", "dX", "dW1", "dW2", "dS"), got[:5], ref[:5]):
        assert rel_err(g, r) < BF16_TOL, name
    bf16_ref = _layer("reference", x, w1, w2, plan, dout)
    assert got[5] == bf16_ref[5], "saved bytes differ from the reference's"


@pytest.mark.gpu
@needs_cute
def test_layer_forward_backward_fp16(monkeypatch):
    """fp16 activations and weights: every kernel writes fp16 (the staged epilogues once staged bf16 bits, which
    an fp16 tensor then read as garbage). Staged and direct stores both run: dH always stages."""
    from sonic.kernels.cute import function
    from tests.conftest import poisoned_empty

    monkeypatch.setattr(function, "_alloc", poisoned_empty)
    T, D, N, E, K = 640, 256, 128, 8, 2
    plan = make_plan(T, E, K, "skewed", seed=22)
    x, w1, w2 = (t.half() for t in inputs(T, D, N, E, seed=5))
    dout = torch.randn(T, D, device="cuda").half()
    got = _layer("cute", x, w1, w2, plan, dout)
    ref = _layer("reference", x.float(), w1.float(), w2.float(), plan, dout.float())
    for name, g, r in zip(("O", "dX", "dW1", "dW2", "dS"), got[:5], ref[:5]):
        assert g.dtype in (torch.float16, torch.float32) and rel_err(g, r) < BF16_TOL, name


@pytest.mark.gpu
@needs_cute
def test_no_recompilation_across_row_counts():
    from sonic.kernels.cute import ops
    D, N, E, K = 256, 128, 8, 2
    x, w1, w2 = inputs(1024, D, N, E, seed=2)
    dout = torch.randn(1024, D, device="cuda").bfloat16()
    _layer("cute", x, w1, w2, make_plan(1024, E, K, "uniform", 1), dout)  # warm the cache
    before = ops._compiled.cache_info().misses, ops._compiled_gather_sum.cache_info().misses
    for T, routing in ((700, "skewed"), (333, "empty"), (1024, "uniform")):
        _layer("cute", x[:T], w1, w2, make_plan(T, E, K, routing, T), dout[:T])
    after = ops._compiled.cache_info().misses, ops._compiled_gather_sum.cache_info().misses
    assert after == before
