"""Routing kernels: fused top-K + softmax, and the RoutingPlan built on device with no host sync.

Integration point for sonic.routing (owned elsewhere): the router can replace

    top_logits_TK, expert_idx_TK = logits_TE.topk(K); scores_TK = top_logits_TK.softmax(-1)
    plan = plan_from_topk(expert_idx_TK, scores_TK, E)

by `expert_idx_TK, scores_TK = topk_softmax(logits_TE, K)` (differentiable in the logits)
and `plan = plan_from_topk(expert_idx_TK, scores_TK, E)` from this module: the plan is
field-for-field the one sonic.routing.plan.plan_from_topk builds, and scores_R keeps its
autograd history.

The plan is a two-level counting sort: tokens are cut into chunks of BT; per chunk the
pairs are counted per expert (integer atomics), a scan over chunks gives each (chunk,
expert) its first row, and each chunk sorts its own (expert, token) keys in registers to
rank its pairs within an expert. Rows come out sorted by expert then token, exactly as
build_plan's argsort would, with a cost independent of E.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonic.routing.plan import RoutingPlan


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer a kernel writes is allocated here (tests poison it to catch unwritten output)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit(do_not_specialize=["T"])
def _topk_softmax_kernel(logits_TE, idx_TK, scores_TK, T, E: tl.constexpr, K: tl.constexpr,
                         BT: tl.constexpr, BE: tl.constexpr, KP: tl.constexpr):
    """K rounds of (max, lowest index attaining it) per token, then a softmax over the K."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.arange(0, BE)
    tm = t < T
    x = tl.load(logits_TE + t.to(tl.int64)[:, None] * E + e[None, :],
                mask=tm[:, None] & (e < E)[None, :], other=float("-inf")).to(tl.float32)
    taken = (e >= E)[None, :] | (t < 0)[:, None]  # padding columns never win
    kk = tl.arange(0, KP)
    top_v = tl.full((BT, KP), float("-inf"), tl.float32)
    top_i = tl.zeros((BT, KP), tl.int32)
    for k in tl.static_range(K):
        xv = tl.where(taken, float("-inf"), x)
        m = tl.max(xv, axis=1)
        i = tl.min(tl.where((xv == m[:, None]) & ~taken, e[None, :], BE), axis=1)
        top_v = tl.where(kk[None, :] == k, m[:, None], top_v)
        top_i = tl.where(kk[None, :] == k, i[:, None], top_i)
        taken = taken | (e[None, :] == i[:, None])
    mx = tl.max(top_v, axis=1)
    p = tl.where(kk[None, :] < K, tl.exp(top_v - mx[:, None]), 0.0)
    p = p / tl.sum(p, axis=1)[:, None]
    om = tm[:, None] & (kk < K)[None, :]
    out = t.to(tl.int64)[:, None] * K + kk[None, :]
    tl.store(idx_TK + out, top_i, mask=om)
    tl.store(scores_TK + out, p, mask=om)


class _TopKSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE: Tensor, k: int):
        T, E = logits_TE.shape
        logits_TE = logits_TE.contiguous()
        idx_TK = _alloc((T, k), torch.int32, logits_TE.device)
        scores_TK = _alloc((T, k), torch.float32, logits_TE.device)
        if T:
            be = max(16, triton.next_power_of_2(E))
            bt = max(1, min(64, 2048 // be))
            _topk_softmax_kernel[(triton.cdiv(T, bt),)](
                logits_TE, idx_TK, scores_TK, T, E=E, K=k, BT=bt, BE=be,
                KP=max(2, triton.next_power_of_2(k)), num_warps=4 if be <= 1024 else 8)
        ctx.save_for_backward(idx_TK, scores_TK)
        ctx.shape, ctx.dtype = (T, E), logits_TE.dtype
        ctx.mark_non_differentiable(idx_TK)
        return idx_TK, scores_TK

    @staticmethod
    def backward(ctx, _didx, dscores_TK):
        idx_TK, scores_TK = ctx.saved_tensors
        # softmax over the K picks: dl_k = s_k (g_k - sum_j s_j g_j); other logits get 0
        g = dscores_TK.float()
        dl_TK = scores_TK * (g - (scores_TK * g).sum(-1, keepdim=True))
        dlogits_TE = torch.zeros(ctx.shape, dtype=torch.float32, device=g.device)
        dlogits_TE.scatter_(1, idx_TK.long(), dl_TK)
        return dlogits_TE.to(ctx.dtype), None


def topk_softmax(logits_TE: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(expert_idx_TK int32, scores_TK float32): top-K logits, softmax over the K picks.

    Differentiable in logits_TE through scores_TK. Ties go to the lower expert index.
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE must be (tokens, experts), got {tuple(logits_TE.shape)}")
    if not 1 <= k <= logits_TE.shape[1]:
        raise ValueError(f"top_k={k} must be between 1 and the number of experts {logits_TE.shape[1]}")
    return _TopKSoftmax.apply(logits_TE, k)


@triton.jit(do_not_specialize=["T"])
def _count_kernel(idx_TK, counts_CE, T, E: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                  KP: tl.constexpr):
    """counts[c, e] = pairs of chunk c routed to e (integer atomics: exact, order-free)."""
    c = tl.program_id(0)
    t = c * BT + tl.arange(0, BT)
    k = tl.arange(0, KP)
    m = (t < T)[:, None] & (k < K)[None, :]
    e = tl.load(idx_TK + t.to(tl.int64)[:, None] * K + k[None, :], mask=m, other=0)
    tl.atomic_add(counts_CE + c.to(tl.int64) * E + e, tl.full((BT, KP), 1, tl.int32), mask=m, sem="relaxed")


@triton.jit(do_not_specialize=["C"])
def _scan_chunks_kernel(counts_CE, base_CE, total_E, C, E: tl.constexpr, BC: tl.constexpr,
                        BE: tl.constexpr):
    """base[c, e] = sum_{c' < c} counts[c', e]; total[e] = sum_c counts[c, e]."""
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < E
    carry = tl.zeros((BE,), tl.int32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        m = (c < C)[:, None] & em[None, :]
        ptr = c.to(tl.int64)[:, None] * E + e[None, :]
        v = tl.load(counts_CE + ptr, mask=m, other=0)
        incl = tl.cumsum(v, axis=0)
        tl.store(base_CE + ptr, carry[None, :] + incl - v, mask=m)
        carry += tl.sum(v, axis=0)
    tl.store(total_E + e, carry, mask=em)


@triton.jit
def _expert_offsets_kernel(total_E, expert_offsets_E1, E: tl.constexpr, BE: tl.constexpr):
    """expert_offsets = [0, cumsum(total)], one program."""
    carry = 0
    tl.store(expert_offsets_E1, 0)
    for e0 in range(0, E, BE):
        e = e0 + tl.arange(0, BE)
        v = tl.load(total_E + e, mask=e < E, other=0)
        tl.store(expert_offsets_E1 + 1 + e, carry + tl.cumsum(v, axis=0), mask=e < E)
        carry += tl.sum(v, axis=0)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["T"])
def _scatter_kernel(idx_TK, base_CE, expert_offsets_E1, token_idx_R, expert_idx_R, order_R,
                    rows_by_token_R, T, E: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                    KP: tl.constexpr):
    """Rows of chunk c's pairs: sort the chunk's (expert, token, k, slot) keys in registers.

    After the sort a pair's rank among the chunk's pairs of its expert is its position
    minus the position where its expert's run starts; the row is then
    expert_offsets[e] + base[c, e] (earlier chunks) + that rank. slot = the rank of the
    expert among the token's K, which orders rows_by_token like build_plan's stable argsort.
    """
    c = tl.program_id(0)
    t = c * BT + tl.arange(0, BT)
    k = tl.arange(0, KP)
    t64 = t.to(tl.int64)
    m = (t < T)[:, None] & (k < K)[None, :]
    e = tl.load(idx_TK + t64[:, None] * K + k[None, :], mask=m, other=0)
    slot = tl.zeros((BT, KP), tl.int32)
    for k2 in tl.static_range(K):
        e2 = tl.load(idx_TK + t64 * K + k2, mask=t < T, other=0)
        slot += (e2[:, None] < e).to(tl.int32)
    tloc = tl.arange(0, BT)[:, None]
    key = ((e * BT + tloc) * KP + k[None, :]) * KP + slot
    key = tl.where(m, key, 2147483647)
    key = tl.sort(tl.reshape(key, (BT * KP,)))
    valid = key != 2147483647
    slot_s = key % KP
    k_s = (key // KP) % KP
    t_s = c * BT + (key // (KP * KP)) % BT
    e_s = tl.where(valid, key // (KP * KP * BT), 0)
    pos = tl.arange(0, BT * KP)
    prev = tl.gather(e_s, tl.maximum(pos - 1, 0), 0)
    first = tl.associative_scan(tl.where((pos == 0) | (e_s != prev), pos, 0), 0, _max_combine)
    row = tl.load(expert_offsets_E1 + e_s, mask=valid, other=0) + \
        tl.load(base_CE + c.to(tl.int64) * E + e_s, mask=valid, other=0) + pos - first
    tl.store(token_idx_R + row, t_s, mask=valid)
    tl.store(expert_idx_R + row, e_s, mask=valid)
    tl.store(order_R + row, t_s * K + k_s, mask=valid)
    tl.store(rows_by_token_R + t_s.to(tl.int64) * K + slot_s, row, mask=valid)


class _Permute(torch.autograd.Function):
    """out_R = src[order_R] for a permutation: the backward is a plain scatter (no sort, no atomics)."""

    @staticmethod
    def forward(ctx, src: Tensor, order_R: Tensor):
        ctx.save_for_backward(order_R)
        return src[order_R]

    @staticmethod
    def backward(ctx, grad_R: Tensor):
        (order_R,) = ctx.saved_tensors
        return torch.empty_like(grad_R).index_copy_(0, order_R, grad_R), None


def plan_from_topk(expert_idx_TK: Tensor, scores_TK: Tensor, num_experts: int) -> RoutingPlan:
    """Same plan as sonic.routing.plan.plan_from_topk, built by Triton kernels without a sync.

    Every token must have K distinct experts in [0, num_experts). scores_R = scores_TK
    reordered, keeping its autograd history.
    """
    if expert_idx_TK.dim() != 2 or expert_idx_TK.shape != scores_TK.shape:
        raise ValueError(f"expert_idx_TK {tuple(expert_idx_TK.shape)} and scores_TK "
                         f"{tuple(scores_TK.shape)} must both be (tokens, K)")
    T, K = expert_idx_TK.shape
    E = num_experts
    dev = expert_idx_TK.device
    idx_TK = expert_idx_TK.to(torch.int32).contiguous()
    R = T * K
    be = max(16, min(128, triton.next_power_of_2(E)))
    kp = max(2, triton.next_power_of_2(K))
    bt = max(16, 1024 // kp)  # a chunk sorts bt * kp keys
    C, EB = triton.cdiv(T, bt), triton.cdiv(E, be)
    counts_CE = torch.zeros((C, E), dtype=torch.int32, device=dev)  # atomics accumulate into it
    base_CE = _alloc((C, E), torch.int32, dev)
    total_E = _alloc((E,), torch.int32, dev)
    expert_offsets_E1 = _alloc((E + 1,), torch.int32, dev)
    token_idx_R, expert_idx_R, order_R, rows_by_token_R = (_alloc((R,), torch.int32, dev) for _ in range(4))
    if T:
        _count_kernel[(C,)](idx_TK, counts_CE, T, E=E, K=K, BT=bt, KP=kp, num_warps=4)
        _scan_chunks_kernel[(EB,)](counts_CE, base_CE, total_E, C, E=E, BC=32, BE=be, num_warps=4)
    else:
        total_E.zero_()
    _expert_offsets_kernel[(1,)](total_E, expert_offsets_E1, E=E,
                                 BE=max(16, min(4096, triton.next_power_of_2(E))), num_warps=4)
    if T:
        _scatter_kernel[(C,)](idx_TK, base_CE, expert_offsets_E1, token_idx_R, expert_idx_R, order_R,
                              rows_by_token_R, T, E=E, K=K, BT=bt, KP=kp, num_warps=8)
    token_offsets_T1 = torch.arange(0, R + 1, K, dtype=torch.int32, device=dev)
    return RoutingPlan(token_idx_R=token_idx_R, expert_idx_R=expert_idx_R,
                       scores_R=_Permute.apply(scores_TK.reshape(-1), order_R.long()),
                       expert_offsets_E1=expert_offsets_E1, token_offsets_T1=token_offsets_T1,
                       rows_by_token_R=rows_by_token_R)


def route_topk(logits_TE: Tensor, k: int) -> RoutingPlan:
    """Top-K + softmax over the picks + plan, all on device: the router's default path."""
    idx_TK, scores_TK = topk_softmax(logits_TE, k)
    return plan_from_topk(idx_TK, scores_TK, logits_TE.shape[1])
