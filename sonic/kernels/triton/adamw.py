"""AdamW's update of many parameter tensors in one launch and one pass (optim.implementation=triton,
`sonic.train.optim.TritonAdamW`).

Per element it reads the parameter, its gradient and the two moments once, and writes the parameter and the
moments once: 28 bytes per fp32 parameter, against torch's fused AdamW's 28 bytes plus, when the gradients are
clipped, a read and a write of every gradient (torch's clip scales them in place before the step, and its fused
kernel, given the clip as `grad_scale`, writes the scaled gradient back). Here the clip is a divisor the kernel
applies as it reads the gradient, and nothing is written back to the gradient.

The arithmetic is torch's AdamW (torch/optim/adamw.py, fused and foreach agree to rounding):
  p <- p - lr * wd * p;  m <- m + (1 - b1) (g - m);  v <- b2 v + (1 - b2) g^2
  p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
with t the step count after this step, read from the device (skipped steps do not advance it), and the bias
corrections in fp32 (torch's fused kernel takes them in fp64: the updates agree to ~1e-7 relative).
`found_inf` != 0 leaves everything untouched, as in torch's fused kernel.

With `master` (an fp32 copy of a bf16 parameter, `TritonAdamW(compute_dtype=...)`), the arithmetic runs on the
master, and the parameter is written as the master rounded to its dtype. With a bf16 gradient that is 28 bytes
per weight as before, and the 12 bytes of casting each fp32 weight for the forward and its gradient back after
the backward are gone. Without a master (a bf16 parameter stepped in place, optim.master_weights=none) and with
bf16 moments it is 14 bytes per weight, against 20 with the master.

With bf16 moments (`TritonAdamW(moment_dtype=torch.bfloat16)`, optim.moment_dtype) the moments are read and
written as bf16, 8 bytes per weight fewer, and computed in fp32 as above. They are stored with stochastic
rounding: round to nearest would lose every update smaller than half a bf16 step of the moment (v <- b2 v +
(1 - b2) g^2 then stalls once (1 - b2) g^2 / v falls under 2^-9), stochastic rounding keeps each update in
expectation. A bf16 parameter without a master (optim.master_weights=none) is stored the same way: at the end of
a cosine schedule most updates are a fraction of a bf16 step of the weight, and round to nearest would drop them
all. The random bits come from the step count and the parameter's `salt`, so a resumed run draws the
same ones. They are a murmur3 finaliser of the element's offset and that seed, 32 bits per element (16 per
moment): Philox (tl.randint4x) spent ~100 integer instructions per element and made the step compute-bound, as
long as with fp32 moments (a 40-layer sonic_7b step on an H200, e2e rows 55-58 of docs/performance.md).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonic.device import to_device

BLOCK = 2048  # elements per program: a streaming kernel, 8 warps, four 16-byte loads per stream per thread
WARPS = 8
NORM_BLOCK = 8192  # elements per program of `sum_squares`: one stream, so larger blocks for the same bytes in flight


@triton.jit
def _stochastic_bf16(x, bits):
    """fp32 x rounded to bf16 up or down, up with probability the dropped fraction (bits: 16 random low bits)."""
    u = x.to(tl.uint32, bitcast=True)
    up = ((u + (bits & 0xFFFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)  # exact in bf16: the cast keeps it
    return tl.where(x == x, up, x).to(tl.bfloat16)  # NaN stays NaN (its carry could reach the sign)


@triton.jit
def _mix32(x):
    """murmur3's 32-bit finaliser: every input bit reaches every output bit (a bijection of uint32)."""
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _random_bits(seed, offs):
    """32 random bits per element: a hash of its offset (the low 32 bits) and the seed, ~10 instructions."""
    key = _mix32(seed.to(tl.uint32) ^ (seed >> 32).to(tl.uint32))
    return _mix32(offs.to(tl.uint32) * 0x9E3779B1 + key)


FIELDS = tl.constexpr(8)  # per tensor in the address table: param, master, grad, exp_avg, exp_avg_sq, step, n, salt


@triton.jit
def _load(ptr, offs, n, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=offs < n, other=0.0)
    else:
        return tl.load(ptr + offs)


@triton.jit
def _store(ptr, offs, n, value, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value, mask=offs < n)
    else:
        tl.store(ptr + offs, value)


@triton.jit
def _adamw_block(p_ptr, master_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, offs, n, step, seed,
                 lr, weight_decay, beta1, beta2, log2_beta1, log2_beta2, eps,
                 HAS_MASTER: tl.constexpr, HAS_SCALE: tl.constexpr, BF16_MOMENTS: tl.constexpr, SR_PARAM: tl.constexpr,
                 MASKED: tl.constexpr):
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    g = _load(g_ptr, offs, n, MASKED).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr).to(tl.float32)
    if HAS_MASTER:
        p = _load(master_ptr, offs, n, MASKED)
    else:
        p = _load(p_ptr, offs, n, MASKED).to(tl.float32)
    m = _load(m_ptr, offs, n, MASKED).to(tl.float32)
    v = _load(v_ptr, offs, n, MASKED).to(tl.float32)
    p = p - lr * weight_decay * p
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    if BF16_MOMENTS or SR_PARAM:
        bits = _random_bits(seed, offs)
    if HAS_MASTER:
        _store(master_ptr, offs, n, p, MASKED)
    if SR_PARAM:
        _store(p_ptr, offs, n, _stochastic_bf16(p, _mix32(bits)), MASKED)  # 16 more bits, apart from the moments'
    else:
        _store(p_ptr, offs, n, p.to(p_ptr.dtype.element_ty), MASKED)
    if BF16_MOMENTS:
        _store(m_ptr, offs, n, _stochastic_bf16(m, bits), MASKED)
        _store(v_ptr, offs, n, _stochastic_bf16(v, bits >> 16), MASKED)
    else:
        _store(m_ptr, offs, n, m.to(m_ptr.dtype.element_ty), MASKED)
        _store(v_ptr, offs, n, v.to(v_ptr.dtype.element_ty), MASKED)


@triton.jit
def _address(row, field, like, ALIGNED: tl.constexpr):
    """A pointer to `like`'s element type from the table; ALIGNED: every address of the launch is a multiple of 16
    bytes, which the compiler needs to know (as it does of a pointer argument) to load 16 bytes at a time."""
    ptr = tl.load(row + field).to(like.dtype)
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _adamw_kernel(table_ptr, blocks_ptr, p_like, master_like, g_like, m_like, step_like, scale_ptr, skip_ptr,
                  lr, weight_decay, beta1, beta2, log2_beta1, log2_beta2, eps,
                  HAS_MASTER: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SKIP: tl.constexpr,
                  BF16_MOMENTS: tl.constexpr, SR_PARAM: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """One BLOCK of one tensor per program: blocks_ptr holds (tensor, block) per program, table_ptr each tensor's
    FIELDS (addresses as int64, numel, salt). The *_like arguments: tensors whose dtypes every tensor of the launch
    shares (the addresses carry none). A full block loads and stores unmasked: a mask against a numel read from
    memory would keep the compiler from 16-byte accesses."""
    if HAS_SKIP:
        if tl.load(skip_ptr) != 0:
            return
    pid = tl.program_id(0)
    row = table_ptr + tl.load(blocks_ptr + 2 * pid).to(tl.int64) * FIELDS
    p_ptr = _address(row, 0, p_like, ALIGNED)
    master_ptr = _address(row, 1, master_like, ALIGNED)
    g_ptr = _address(row, 2, g_like, ALIGNED)
    m_ptr = _address(row, 3, m_like, ALIGNED)
    v_ptr = _address(row, 4, m_like, ALIGNED)
    step = tl.load(_address(row, 5, step_like, False))
    n = tl.load(row + 6)
    first = tl.load(blocks_ptr + 2 * pid + 1).to(tl.int64) * BLOCK
    offs = first + tl.arange(0, BLOCK)
    seed = step.to(tl.int64) * 65537 + tl.load(row + 7)
    if first + BLOCK <= n:
        _adamw_block(p_ptr, master_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, offs, n, step, seed, lr, weight_decay,
                     beta1, beta2, log2_beta1, log2_beta2, eps, HAS_MASTER, HAS_SCALE, BF16_MOMENTS, SR_PARAM, False)
    else:
        _adamw_block(p_ptr, master_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, offs, n, step, seed, lr, weight_decay,
                     beta1, beta2, log2_beta1, log2_beta2, eps, HAS_MASTER, HAS_SCALE, BF16_MOMENTS, SR_PARAM, True)


@triton.jit
def _sum_squares_kernel(table_ptr, blocks_ptr, like, out_ptr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """out[program] = the fp32 sum of squares of one BLOCK of one tensor: blocks_ptr holds (tensor, block) per
    program, table_ptr each tensor's address and numel; `like` shares the tensors' dtype."""
    pid = tl.program_id(0)
    row = table_ptr + tl.load(blocks_ptr + 2 * pid).to(tl.int64) * 2
    ptr = _address(row, 0, like, ALIGNED)
    n = tl.load(row + 1)
    first = tl.load(blocks_ptr + 2 * pid + 1).to(tl.int64) * BLOCK
    offs = first + tl.arange(0, BLOCK)
    if first + BLOCK <= n:
        x = _load(ptr, offs, n, False).to(tl.float32)
    else:
        x = _load(ptr, offs, n, True).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(x * x, axis=0))


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else float("-inf")  # beta = 0: no bias correction (exp2(-inf) = 0)


def block_table(numels: list[int], device: torch.device, block: int = BLOCK) -> Tensor:
    """(tensor, block) of every program of one launch over tensors of these sizes, `block` elements per program:
    int32 (programs, 2). It depends on the sizes alone, so a caller keeps it from step to step."""
    blocks = torch.tensor([triton.cdiv(n, block) for n in numels], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(numels)), blocks)
    first = torch.repeat_interleave(torch.cumsum(blocks, 0) - blocks, blocks)  # the owner's first program
    return to_device(torch.stack([owner, torch.arange(len(owner)) - first], dim=1).to(torch.int32), device)


def adamw_tensors_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                   steps: list[Tensor], *, lr: float, weight_decay: float, beta1: float, beta2: float, eps: float,
                   grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
                   masters: list[Tensor] | None = None, salts: list[int] | None = None,
                   blocks: Tensor | None = None) -> None:
    """One AdamW step of every tensor in `params` in place (and of its moments), in one launch: the host cost of a
    launch is paid once, not once per tensor (several hundred in a model). The tensors share each list's dtype and
    one device. `steps`: each parameter's step count after this step, a 0-d fp32 tensor on the device;
    `grad_scale`: a 0-d divisor of the gradients (the clip); `found_inf`: a 0-d flag, nonzero to leave everything
    as it is; `masters`: the parameters' fp32 master copies, which take the step (each parameter gets its master
    rounded). bf16 moments, and bf16 parameters without masters, are stored with stochastic rounding, seeded by the
    step and `salts` (a number of each parameter's own). `blocks`: `block_table` of the sizes, if the caller keeps it."""
    lists = [params, grads, exp_avgs, exp_avg_sqs, steps] + ([masters] if masters is not None else [])
    assert len({len(x) for x in lists}) == 1 and params, [len(x) for x in lists]
    for i, p in enumerate(params):
        tensors = [grads[i], exp_avgs[i], exp_avg_sqs[i]] + ([masters[i]] if masters is not None else [])
        assert p.is_contiguous() and all(t.is_contiguous() and t.shape == p.shape for t in tensors)
        assert steps[i].numel() == 1 and steps[i].dtype == torch.float32, steps[i]
        assert all(x[i].dtype == x[0].dtype and x[i].device == p.device for x in lists[:4]), "one dtype per list"
        assert masters is None or masters[i].dtype == torch.float32
    bf16_moments = exp_avgs[0].dtype == torch.bfloat16
    assert exp_avg_sqs[0].dtype == exp_avgs[0].dtype and (bf16_moments or exp_avgs[0].dtype == torch.float32)
    device = params[0].device
    numels = [p.numel() for p in params]
    blocks = block_table(numels, device) if blocks is None else blocks
    if not len(blocks):
        return
    salts = salts or [0] * len(params)
    rows = [[p.data_ptr(), (masters[i] if masters is not None else p).data_ptr(), grads[i].data_ptr(),
             exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(), steps[i].data_ptr(), numels[i], salts[i]]
            for i, p in enumerate(params)]
    table = torch.tensor(rows, dtype=torch.int64)
    aligned = bool((table[:, :5] % 16 == 0).all())
    table = to_device(table, device)
    _adamw_kernel[(len(blocks),)](
        table, blocks, params[0], masters[0] if masters is not None else steps[0], grads[0], exp_avgs[0], steps[0],
        grad_scale if grad_scale is not None else steps[0], found_inf if found_inf is not None else steps[0], lr,
        weight_decay, beta1, beta2, _log2(beta1), _log2(beta2), eps, HAS_MASTER=masters is not None,
        HAS_SCALE=grad_scale is not None, HAS_SKIP=found_inf is not None, BF16_MOMENTS=bf16_moments,
        SR_PARAM=masters is None and params[0].dtype == torch.bfloat16, ALIGNED=aligned,
        BLOCK=BLOCK, num_warps=WARPS)


def sum_squares(tensors: list[Tensor], blocks: Tensor | None = None) -> Tensor:
    """The sum of the squares of every element of `tensors` (contiguous, one dtype and device), accumulated in fp32,
    as a 0-d fp32 tensor on their device: one launch over all of them and a sum of its per-program partials. It
    reads each element once (a clip's gradient norm: torch's multi-tensor norm took ~2x the bytes' time, see
    `TritonAdamW.global_norm`). `blocks`: `block_table(sizes, device, NORM_BLOCK)`, if the caller keeps it."""
    assert tensors and all(t.dtype == tensors[0].dtype and t.device == tensors[0].device and t.is_contiguous()
                           for t in tensors), "one dtype and device, contiguous"
    device = tensors[0].device
    numels = [t.numel() for t in tensors]
    blocks = block_table(numels, device, NORM_BLOCK) if blocks is None else blocks
    partials = torch.zeros(len(blocks), dtype=torch.float32, device=device)
    if len(blocks):
        table = torch.tensor([[t.data_ptr(), n] for t, n in zip(tensors, numels)], dtype=torch.int64)
        aligned = bool((table[:, 0] % 16 == 0).all())
        _sum_squares_kernel[(len(blocks),)](to_device(table, device), blocks, tensors[0], partials, ALIGNED=aligned,
                                            BLOCK=NORM_BLOCK, num_warps=WARPS)
    return partials.sum()
