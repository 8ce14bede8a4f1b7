"""Token rounding's selection in one Triton kernel: the triton routing backend's `token_rounding_rows`, with the
torch backend's semantics (sonic/routing/token_rounding.py, select_rows) and output.

Expert e keeps the first c_e tokens of its ranking by (key desc, P desc, token asc), where the key is the top-K
gate for its top-K picks and P - 1 for the others (the module docstring there, step 3). One program per expert
finds the c_e-th entry of that order by bisection on the keys' bit patterns (32 counting passes over its
row, in L1/L2 after the first), then on P's among the keys tied with it (only when some tie straddles c_e),
and writes its kept tokens in token order at its first row (the exclusive sum of the c_e). No sort of T x E
or of the T*K picks, no histogram, no host sync. On an H100 at T = 16384, E = 128, K = 8 the torch selection
took about 0.55 ms of GPU time in ~60 launches.

nearest_score decides c_e from ranked gate sums, which this kernel does not form; it and non-fp32 scores take
the torch selection.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonic.routing import token_rounding
from sonic.routing.token_choice import count_per_expert

_EC_MAX = -float.fromhex("0x1p-149")  # the largest negative fp32: an EC key stays below every top-K gate (>= 0)


@triton.jit
def _ordered(bits):
    """fp32 bit patterns (int32) -> int32 keys in the floats' order (for the finite values routing holds)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _count_from(key_T, prob_T, T, kv, pv, USE_P: tl.constexpr, BLOCK: tl.constexpr):
    """How many tokens rank at or above (kv, pv): key > kv, or key == kv and P >= pv (only key >= kv without
    USE_P). Keys as _ordered ints, P as its bits (P >= 0, so its bits order it)."""
    n = tl.zeros((), tl.int32)
    for start in range(0, T, BLOCK):
        t = start + tl.arange(0, BLOCK)
        m = t < T
        k = _ordered(tl.load(key_T + t, mask=m, other=0))
        if USE_P:
            hit = (k > kv) | ((k == kv) & (tl.load(prob_T + t, mask=m, other=0) >= pv))
        else:
            hit = k >= kv
        n += tl.sum((hit & m).to(tl.int32), axis=0)
    return n


@triton.jit(do_not_specialize=["T"])
def _keep_kernel(key_ET, prob_ET, rounded_E, start_E, pairs_R2, T, BLOCK: tl.constexpr):
    """Program e: the (e, token) pairs of its first c_e tokens by (key, P) desc, token asc, in token order at
    rows start_e ...; key_ET/prob_ET are fp32 bit patterns (E x T)."""
    e = tl.program_id(0)
    c = tl.load(rounded_E + e).to(tl.int32)
    key_T = key_ET + e.to(tl.int64) * T
    prob_T = prob_ET + e.to(tl.int64) * T
    if c > 0:
        # kv: the largest key with at least c tokens at or above it (bisection over the int32 range)
        lo = tl.full((), -2147483648, tl.int64)
        hi = tl.full((), 2147483647, tl.int64)
        for _ in range(32):
            mid = lo + (hi - lo + 1) // 2
            ok = _count_from(key_T, prob_T, T, mid.to(tl.int32), 0, False, BLOCK) >= c
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        kv = lo.to(tl.int32)
        # pv: among the tokens at key kv, the largest P with c tokens at or above (kv, pv); -1 (below every
        # P) when all of them are kept
        pv = tl.full((), -1, tl.int32)
        if _count_from(key_T, prob_T, T, kv, 0, False, BLOCK) > c:
            lo = tl.full((), 0, tl.int64)
            hi = tl.full((), 0x7F800000, tl.int64)
            for _ in range(31):
                mid = lo + (hi - lo + 1) // 2
                ok = _count_from(key_T, prob_T, T, kv, mid.to(tl.int32), True, BLOCK) >= c
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid - 1)
            pv = lo.to(tl.int32)
        room = c - _count_from(key_T, prob_T, T, kv, pv + 1, True, BLOCK)  # of the tokens at exactly (kv, pv)
        first = tl.load(start_E + e)
        written = tl.zeros((), tl.int32)
        tied = tl.zeros((), tl.int32)
        for start in range(0, T, BLOCK):
            t = start + tl.arange(0, BLOCK)
            m = t < T
            k = _ordered(tl.load(key_T + t, mask=m, other=0))
            p = tl.load(prob_T + t, mask=m, other=0)
            tie = (m & (k == kv) & (p == pv)).to(tl.int32)
            keep = m & ((k > kv) | ((k == kv) & (p > pv)))
            keep = (keep | ((tie != 0) & (tied + tl.cumsum(tie, axis=0) - tie < room))).to(tl.int32)
            row = (first + written + tl.cumsum(keep, axis=0) - keep) * 2
            tl.store(pairs_R2 + row, tl.zeros_like(row) + e, mask=keep != 0)
            tl.store(pairs_R2 + row + 1, t.to(tl.int64), mask=keep != 0)
            written += tl.sum(keep, axis=0)
            tied += tl.sum(tie, axis=0)


def select_rows(probs_TE: Tensor, expert_idx_TK: Tensor, gates_TK: Tensor, residual_E: Tensor | None, tile: int,
                mode: str, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """sonic.routing.token_rounding.select_rows, the selection in one kernel (module docstring)."""
    if mode == "nearest_score" or probs_TE.dtype != torch.float32:
        return token_rounding.select_rows(probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows)
    T, E = probs_TE.shape
    counts_E = count_per_expert(expert_idx_TK, E)
    rounded_E = token_rounding.round_counts(counts_E, tile, mode, T, residual_E=residual_E)
    start_E = rounded_E.cumsum(0) - rounded_E
    probs_ET = probs_TE.T.contiguous()
    key_ET = torch.sub(probs_ET, 1).clamp_(max=_EC_MAX)
    key_ET.scatter_(0, expert_idx_TK.T, gates_TK.T.to(key_ET.dtype))
    pairs_R2 = torch.full((rows, 2), -1, dtype=torch.int64, device=probs_TE.device)
    if T:
        block = min(8192, max(16, triton.next_power_of_2(T)))
        _keep_kernel[(E,)](key_ET.view(torch.int32), probs_ET.view(torch.int32), rounded_E, start_E, pairs_R2, T,
                           BLOCK=block, num_warps=8)
    return pairs_R2, counts_E, rounded_E


@torch.library.custom_op("sonic::token_rounding_rows_triton", mutates_args=())
def token_rounding_rows(probs_TE: Tensor, expert_idx_TK: Tensor, gates_TK: Tensor, residual_E: Tensor | None,
                        tile: int, mode: str, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """The torch backend's sonic::token_rounding_rows with select_rows above (on CUDA through its CUDA graph)."""
    return select_rows(probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows)


@token_rounding_rows.register_kernel("cuda")
def _(probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows):
    return token_rounding.replay_graphed(select_rows, probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows)


token_rounding_rows.register_fake(token_rounding.rounded_rows_fake)
