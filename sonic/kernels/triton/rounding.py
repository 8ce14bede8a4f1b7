"""Token rounding's selection in Triton kernels: the triton routing backend's `token_rounding_rows`, with the
torch backend's semantics (sonic/routing/token_rounding.py, select_rows) and output.

Expert e keeps the first c_e tokens of its ranking: its top-K (TC) picks by gate, then the others (EC) by P,
ties by P, then token (the module docstring there, step 3). Two kernels (and a column sum):
  _keys_kernel   per tile of tokens: the ranking keys as int32, experts x tokens (a TC key is the gate's bits,
                 an EC key P's bits shifted below every TC key: the class order and each class's float order
                 in one integer), P's bits, and the top-K picks per expert and tile (summed into f_e in tile order)
  _keep_kernel   per expert: the c_e-th entry of its order by bisection on the keys (32 counting passes over
                 its row, held in registers up to 16384 tokens), then on P among the keys tied with it (only
                 when a tie straddles c_e); its kept tokens go in token order to its first row (the exclusive
                 sum of the c_e)
No sort of T x E or of the T*K picks, no histogram, no host sync. On an H100 at T = 16384, E = 128, K = 8 the
torch selection took about 0.55 ms of GPU time in ~60 launches.

nearest_score decides c_e from ranked gate sums, which this kernel does not form; it and non-fp32 scores take
the torch selection.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonic.routing import token_rounding

_EC_SHIFT = tl.constexpr(0x7F800001)  # EC keys are P's bits minus this: below every TC key (a gate's bits, >= 0)
_RESIDENT_T = 16384  # up to this many tokens an expert's row stays in registers through the bisection
_CHUNK = 4096  # beyond, the row is read in blocks of this many tokens per counting pass
_KEEP_WARPS = 16  # the keep kernel's warps on a resident row of more than 4096 tokens


@triton.jit(do_not_specialize=["T"])
def _keys_kernel(probs_TE, idx_TK, gates_TK, key_ET, prob_ET, counts_CE, T, E: tl.constexpr, K: tl.constexpr,
                 BT: tl.constexpr, BE: tl.constexpr):
    """One tile of tokens: the ranking keys as int32 in E x T (TC: the gate's bits; EC: P's bits - _EC_SHIFT,
    so every TC key is above every EC key and each class keeps its float order, P at full precision), P's
    bits in E x T, and this tile's top-K picks per expert (counts_CE[tile])."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.arange(0, BE)
    tm = t < T
    m = tm[:, None] & (e < E)[None, :]
    p = tl.load(probs_TE + t.to(tl.int64)[:, None] * E + e[None, :], mask=m, other=0.0)
    key = p.to(tl.int32, bitcast=True) - _EC_SHIFT
    picks = tl.zeros((BE,), tl.int32)
    for k in tl.static_range(K):
        ik = tl.load(idx_TK + t.to(tl.int64) * K + k, mask=tm, other=-1)
        gk = tl.load(gates_TK + t.to(tl.int64) * K + k, mask=tm, other=0.0)
        hit = e[None, :] == ik[:, None]
        key = tl.where(hit, gk.to(tl.int32, bitcast=True)[:, None], key)
        picks += tl.sum(hit.to(tl.int32), axis=0)
    out = e.to(tl.int64)[None, :] * T + t[:, None]
    tl.store(key_ET + out, key, mask=m)
    tl.store(prob_ET + out, p.to(tl.int32, bitcast=True), mask=m)
    tl.store(counts_CE + tl.program_id(0) * E + e, picks, mask=e < E)


@triton.jit(do_not_specialize=["C"])
def _column_sum_kernel(counts_CE, counts_E, C, E: tl.constexpr, BC: tl.constexpr, BE: tl.constexpr):
    """counts_E[e] = sum_c counts_CE[c, e], as int64 (a column sum torch runs with few blocks on this shape)."""
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    total = tl.zeros((BE,), tl.int64)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        m = (c < C)[:, None] & (e < E)[None, :]
        total += tl.sum(tl.load(counts_CE + c.to(tl.int64)[:, None] * E + e[None, :], mask=m, other=0), axis=0)
    tl.store(counts_E + e, total, mask=e < E)


@triton.jit
def _count_from(key_T, prob_T, T, kv, pv, k_row, p_row, USE_P: tl.constexpr, RESIDENT: tl.constexpr,
                BLOCK: tl.constexpr):
    """How many tokens rank at or above (kv, pv): key > kv, or key == kv and P's bits >= pv (key >= kv alone
    without USE_P). RESIDENT: the row is k_row/p_row (one block); else it is read in blocks from key_T/prob_T."""
    if RESIDENT:
        m = tl.arange(0, BLOCK) < T
        if USE_P:
            hit = (k_row > kv) | ((k_row == kv) & (p_row >= pv))
        else:
            hit = k_row >= kv
        n = tl.sum((hit & m).to(tl.int32), axis=0)
    else:
        n = tl.zeros((), tl.int32)
        for start in range(0, T, BLOCK):
            t = start + tl.arange(0, BLOCK)
            m = t < T
            k = tl.load(key_T + t, mask=m, other=0)
            if USE_P:
                hit = (k > kv) | ((k == kv) & (tl.load(prob_T + t, mask=m, other=0) >= pv))
            else:
                hit = k >= kv
            n += tl.sum((hit & m).to(tl.int32), axis=0)
    return n


@triton.jit
def _bisect(key_T, prob_T, T, c, kv, k_row, p_row, LO: tl.constexpr, HI: tl.constexpr, USE_P: tl.constexpr,
            RESIDENT: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """The largest x in [LO, HI] with at least c tokens at or above it: x a key (USE_P false) or, among the
    tokens at key kv, a P (USE_P true). STEPS = ceil(log2(HI - LO + 1))."""
    lo = tl.full((), LO, tl.int64)
    hi = tl.full((), HI, tl.int64)
    for _ in range(STEPS):
        mid = lo + (hi - lo + 1) // 2
        if USE_P:
            n = _count_from(key_T, prob_T, T, kv, mid.to(tl.int32), k_row, p_row, True, RESIDENT, BLOCK)
        else:
            n = _count_from(key_T, prob_T, T, mid.to(tl.int32), 0, k_row, p_row, False, RESIDENT, BLOCK)
        lo = tl.where(n >= c, mid, lo)
        hi = tl.where(n >= c, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit(do_not_specialize=["T"])
def _keep_kernel(key_ET, prob_ET, rounded_E, start_E, pairs_R2, T, RESIDENT: tl.constexpr, BLOCK: tl.constexpr):
    """Program e: the (e, token) pairs of its first c_e tokens by key desc, P desc, token asc (int32 keys
    from _keys_kernel, P's bits), written in token order from row start_e."""
    e = tl.program_id(0)
    c = tl.load(rounded_E + e).to(tl.int32)
    key_T = key_ET + e.to(tl.int64) * T
    prob_T = prob_ET + e.to(tl.int64) * T
    k_row = 0
    p_row = 0
    if RESIDENT:  # one load; the ~35 counting passes then run on registers
        t = tl.arange(0, BLOCK)
        k_row = tl.load(key_T + t, mask=t < T, other=0)
        p_row = tl.load(prob_T + t, mask=t < T, other=0)
    if c > 0:
        kv = _bisect(key_T, prob_T, T, c, 0, k_row, p_row, -_EC_SHIFT, 0x7F800000, False, RESIDENT, BLOCK, 32)
        pv = tl.full((), -1, tl.int32)  # below every P: all tokens at key kv are kept...
        if _count_from(key_T, prob_T, T, kv, 0, k_row, p_row, False, RESIDENT, BLOCK) > c:  # ...unless too many
            pv = _bisect(key_T, prob_T, T, c, kv, k_row, p_row, 0, 0x7F800000, True, RESIDENT, BLOCK, 31)
        room = c - _count_from(key_T, prob_T, T, kv, pv + 1, k_row, p_row, True, RESIDENT, BLOCK)  # at (kv, pv)
        first = tl.load(start_E + e)
        written = tl.zeros((), tl.int32)
        tied = tl.zeros((), tl.int32)
        for start in range(0, T, BLOCK):
            t = start + tl.arange(0, BLOCK)
            m = t < T
            k = tl.load(key_T + t, mask=m, other=0)
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
    """sonic.routing.token_rounding.select_rows in three kernels and a few on E (module docstring). The gates are
    probabilities (>= 0), as every gate order gives."""
    if mode == "nearest_score" or probs_TE.dtype != torch.float32 or gates_TK.dtype != torch.float32:
        return token_rounding.select_rows(probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows)
    T, E = probs_TE.shape
    K = expert_idx_TK.shape[1]
    dev = probs_TE.device
    be = max(16, triton.next_power_of_2(E))
    bt = max(1, min(64, 4096 // be))
    key_ET = torch.empty((E, T), dtype=torch.int32, device=dev)
    prob_ET = torch.empty((E, T), dtype=torch.int32, device=dev)
    counts_CE = torch.empty((triton.cdiv(T, bt), E), dtype=torch.int32, device=dev)
    if T:
        _keys_kernel[(triton.cdiv(T, bt),)](probs_TE.contiguous(), expert_idx_TK.contiguous(),
                                            gates_TK.contiguous(), key_ET, prob_ET, counts_CE, T, E=E, K=K, BT=bt,
                                            BE=be, num_warps=4)
    counts_E = torch.empty(E, dtype=torch.int64, device=dev)
    _column_sum_kernel[(triton.cdiv(E, 32),)](counts_CE, counts_E, counts_CE.shape[0], E=E, BC=64, BE=32, num_warps=4)
    rounded_E = token_rounding.round_counts(counts_E, tile, mode, T, residual_E=residual_E)
    start_E = rounded_E.cumsum(0) - rounded_E
    pairs_R2 = torch.full((rows, 2), -1, dtype=torch.int64, device=dev)
    if T:
        resident = T <= _RESIDENT_T
        block = max(16, triton.next_power_of_2(T)) if resident else _CHUNK
        _keep_kernel[(E,)](key_ET, prob_ET, rounded_E, start_E, pairs_R2, T, RESIDENT=resident, BLOCK=block,
                           num_warps=_KEEP_WARPS if block >= 8192 else 8)
    return pairs_R2, counts_E, rounded_E


@torch.library.custom_op("sonic::token_rounding_rows_triton", mutates_args=())
def token_rounding_rows(probs_TE: Tensor, expert_idx_TK: Tensor, gates_TK: Tensor, residual_E: Tensor | None,
                        tile: int, mode: str, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """The torch backend's sonic::token_rounding_rows with select_rows above (on CUDA, as that one, a CUDA graph
    replay: on the H200 the eager call kept the host 0.43 ms per call, the replay 0.24 ms)."""
    return select_rows(probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows)


@token_rounding_rows.register_kernel("cuda")
def _(probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows):
    return token_rounding.replay_graphed(select_rows, probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows)


token_rounding_rows.register_fake(token_rounding.rounded_rows_fake)
