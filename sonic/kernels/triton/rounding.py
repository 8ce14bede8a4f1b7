"""Token rounding's selection and plan in Triton kernels: the last four launches of the triton routing backend's
`route_token_rounding` (sonic/kernels/triton/routing.py), with the semantics of the torch backend's
(sonic/routing/token_rounding.py: rounding rules, ranking, padding).

Expert e keeps the first c_e tokens of its ranking: its top-K (TC) picks by gate, then the others (EC) by P,
ties by P, then token (step 3 of that module's docstring). The select kernel before these writes the ranking keys
as int32, experts x tokens (a TC key is its gate's bits, an EC key P's bits shifted below every TC key: the
class order and each class's float order in one integer) and P's bits; the chunk scan gives f_e. Then:
  _round_kernel       one program: c_e from f_e by the rounding rule, and the expert offsets (the exclusive sum
                      of the c_e)
  _keep_kernel        per expert: nothing to search when c_e = f_e (its TC picks); else the c_e-th key of its ranking
                      by bisection within the class that moves (the TC gates when dropping, the EC keys when adding:
                      30 counting passes over the row, held in registers up to 16384 tokens), then on P among the
                      keys tied with it (only when a tie straddles c_e); its kept tokens are written in token order
                      from its first row (token, expert, gate), and every token's row (or -1) in an experts x tokens
                      map
  _chunk_counts_kernel  per chunk of tokens: its kept rows
  _token_rows_kernel  per chunk of tokens: its tokens' rows in expert order (rows_by_token: no sort by token), the
                      token offsets from the earlier chunks' counts, which top-K pick each kept TC row is (what its
                      gate's gradient joins), and a share of the padding rows past the live ones
No sort, no histogram over T x E, no host sync: the rows are padded to a bound (sonic/routing/plan.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonic.kernels.triton import launch

EC_SHIFT = tl.constexpr(0x7F800001)  # EC keys are P's bits minus this: below every TC key (a gate's bits, >= 0)
_ONE_BITS = tl.constexpr(0x3F800000)  # the bits of 1.0: gates and P's bits are in [0, this]
_STEPS = tl.constexpr(30)  # bisection steps over a range of _ONE_BITS + 1 values
_NO_KEY = tl.constexpr(0x7FFFFFFF)  # above every key: an expert that keeps nothing
MODES = {"nearest": 0, "stochastic": 1, "balance": 2, "up": 3, "down": 4}  # nearest_score: the torch selection
_RESIDENT_T = 16384  # up to this many tokens an expert's keys stay in registers through the bisection
_CHUNK = 4096  # tokens a step reads at a time otherwise, and what the keep kernel writes at a time


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer a kernel here writes is allocated here (tests poison it to catch unwritten output)."""
    return torch.empty(shape, dtype=dtype, device=device)


def token_tile(E: int) -> int:
    """Tokens per program of the chunk-counts and token-rows kernels."""
    return max(1, min(64, 4096 // max(16, triton.next_power_of_2(E))))


@triton.jit(do_not_specialize=["T"])
def _round_kernel(f_E, residual_E, uniform_E, topk_counts_E, rounded_E, expert_offsets_E1, token_offsets_T1, T,
                  E: tl.constexpr, TILE: tl.constexpr, MODE: tl.constexpr, BE: tl.constexpr):
    """c_e from f_e (sonic/routing/token_rounding.py's round_counts): down_e = f_e rounded down to the tile,
    up_e = rounded up (at most T), and the rule picks one; f_e and c_e as int64; offsets = [0, cumsum(c)]."""
    e = tl.arange(0, BE)
    em = e < E
    f = tl.load(f_E + e, mask=em, other=0).to(tl.int64)
    down = f // TILE * TILE
    up = tl.minimum((f + TILE - 1) // TILE * TILE, T)
    rem = f - down
    if MODE == 0:  # nearest
        go_up = 2 * rem >= TILE
    elif MODE == 1:  # stochastic: up with probability rem / TILE
        go_up = tl.load(uniform_E + e, mask=em, other=1.0) * TILE < rem.to(tl.float32)
    elif MODE == 2:  # balance: the residual f - c closest to 0 (tie: down)
        target = tl.load(residual_E + e, mask=em, other=0) + f
        go_up = tl.abs(target - up) < tl.abs(target - down)
    elif MODE == 3:  # up
        go_up = rem >= 0
    else:  # down
        go_up = rem < 0
    c = tl.where(em, tl.where(go_up, up, down), 0)
    tl.store(topk_counts_E + e, f, mask=em)
    tl.store(rounded_E + e, c, mask=em)
    tl.store(expert_offsets_E1 + 1 + e, tl.cumsum(c, axis=0).to(tl.int32), mask=em)
    tl.store(expert_offsets_E1, 0)
    tl.store(token_offsets_T1, 0)


@triton.jit
def _count_from(key_T, prob_T, T, kv, pv, k_row, USE_P: tl.constexpr, RESIDENT: tl.constexpr, ROW: tl.constexpr,
                CHUNK: tl.constexpr):
    """How many tokens rank at or above (kv, pv): key > kv, or key == kv and P's bits >= pv (key >= kv alone
    without USE_P). The keys from k_row (RESIDENT, ROW of them) when P is not needed, else read in chunks; one
    reduction either way."""
    if RESIDENT and not USE_P:
        acc = ((k_row >= kv) & (tl.arange(0, ROW) < T)).to(tl.int32)
    else:
        acc = tl.zeros((CHUNK,), tl.int32)
        for start in range(0, T, CHUNK):
            t = start + tl.arange(0, CHUNK)
            m = t < T
            k = tl.load(key_T + t, mask=m, other=0)
            if USE_P:
                hit = (k > kv) | ((k == kv) & (tl.load(prob_T + t, mask=m, other=0) >= pv))
            else:
                hit = k >= kv
            acc += (hit & m).to(tl.int32)
    return tl.sum(acc, axis=0)


@triton.jit
def _bisect(key_T, prob_T, T, c, kv, lo, k_row, USE_P: tl.constexpr, RESIDENT: tl.constexpr, ROW: tl.constexpr,
            CHUNK: tl.constexpr):
    """The largest x in [lo, lo + _ONE_BITS] with at least c tokens at or above it (given that lo has): x a key (USE_P
    false) or, among the tokens at key kv, a P. One count a step: a step's latency is its reduction's."""
    lo = lo + tl.zeros((), tl.int64)  # a constant or an int32 scalar
    hi = lo + _ONE_BITS
    for _ in range(_STEPS):
        mid = lo + (hi - lo + 1) // 2
        if USE_P:
            n = _count_from(key_T, prob_T, T, kv, mid.to(tl.int32), k_row, True, RESIDENT, ROW, CHUNK)
        else:
            n = _count_from(key_T, prob_T, T, mid.to(tl.int32), 0, k_row, False, RESIDENT, ROW, CHUNK)
        lo = tl.where(n >= c, mid, lo)
        hi = tl.where(n >= c, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit(do_not_specialize=["T"])
def _keep_kernel(key_ET, prob_ET, topk_counts_E, rounded_E, expert_offsets_E1, token_idx_R, expert_idx_R, scores_R,
                 pick_R, row_ET, T, RESIDENT: tl.constexpr, ROW: tl.constexpr, CHUNK: tl.constexpr):
    """Program e: its first c_e tokens by key desc, P desc, token asc, written in token order from its first row:
    the token, e, the gate (a TC key's bits, else P's) and pick -1; row_ET[e] = each token's row or -1. Only the
    boundary moves: c_e = f_e keeps the TC picks, c_e < f_e drops the weakest of them (the c_e-th key is a gate's
    bits), c_e > f_e adds the best EC candidates (an EC key). RESIDENT: the keys of the row (ROW >= T) stay in
    registers through the bisection; the rest is read in chunks of CHUNK tokens (so little else is live)."""
    e = tl.program_id(0)
    c = tl.load(rounded_E + e).to(tl.int32)
    f = tl.load(topk_counts_E + e).to(tl.int32)
    key_T = key_ET + e.to(tl.int64) * T
    prob_T = prob_ET + e.to(tl.int64) * T
    # keep the tokens above (kv, pv), and the first `room` of those at it, by token; c_e = f_e: the TC picks (>= 0)
    kv = tl.full((), -1, tl.int32)
    pv = tl.full((), -1, tl.int32)
    room = tl.zeros((), tl.int32)
    if c == 0:
        kv = tl.full((), _NO_KEY, tl.int32)
    elif c != f:
        k_row = 0
        if RESIDENT:  # one load; the bisection's steps then run on registers
            k_row = tl.load(key_T + tl.arange(0, ROW), mask=tl.arange(0, ROW) < T, other=0)
        lo = tl.where(c < f, 0, -EC_SHIFT)  # a gate's bits, or an EC key (P's bits - EC_SHIFT)
        kv = _bisect(key_T, prob_T, T, c, 0, lo, k_row, False, RESIDENT, ROW, CHUNK)
        # every token at kv is kept (pv = -1), unless a tie straddles c_e: then rank the tokens at kv by P
        if _count_from(key_T, prob_T, T, kv, 0, k_row, False, RESIDENT, ROW, CHUNK) > c:
            pv = _bisect(key_T, prob_T, T, c, kv, 0, k_row, True, RESIDENT, ROW, CHUNK)
            room = c - _count_from(key_T, prob_T, T, kv, pv + 1, k_row, True, RESIDENT, ROW, CHUNK)
    first = tl.load(expert_offsets_E1 + e)
    written = tl.zeros((), tl.int32)
    tied_seen = tl.zeros((), tl.int32)
    for start in range(0, T, CHUNK):
        t = start + tl.arange(0, CHUNK)
        m = t < T
        k = tl.load(key_T + t, mask=m, other=0)
        p = tl.load(prob_T + t, mask=m, other=0)
        tie = (m & (k == kv) & (p == pv)).to(tl.int32)
        keep = m & ((k > kv) | ((k == kv) & (p > pv)))
        keep = keep | ((tie != 0) & (tied_seen + tl.cumsum(tie, axis=0) - tie < room))
        ki = keep.to(tl.int32)
        row = first + written + tl.cumsum(ki, axis=0) - ki
        tl.store(token_idx_R + row, t, mask=keep)
        tl.store(expert_idx_R + row, tl.zeros_like(row) + e, mask=keep)
        tl.store(scores_R + row, tl.where(k >= 0, k, p).to(tl.float32, bitcast=True), mask=keep)
        tl.store(pick_R + row, tl.zeros_like(row) - 1, mask=keep)  # a TC row's pick: _token_rows_kernel
        tl.store(row_ET + e.to(tl.int64) * T + t, tl.where(keep, row, -1), mask=m)
        written += tl.sum(ki, axis=0)
        tied_seen += tl.sum(tie, axis=0)


@triton.jit
def _chunk_rows(row_ET, c, T, E: tl.constexpr, TB: tl.constexpr, BE: tl.constexpr):
    """Chunk c's tokens (TB) x experts: each (token, expert)'s row, or -1."""
    t = c * TB + tl.arange(0, TB)
    e = tl.arange(0, BE)
    return tl.load(row_ET + e.to(tl.int64)[None, :] * T + t[:, None], mask=(t < T)[:, None] & (e < E)[None, :],
                   other=-1)


@triton.jit(do_not_specialize=["T"])
def _chunk_counts_kernel(row_ET, chunk_counts, T, E: tl.constexpr, TB: tl.constexpr, BE: tl.constexpr):
    """chunk_counts[c] = the kept rows of chunk c's tokens."""
    c = tl.program_id(0)
    tl.store(chunk_counts + c, tl.sum(tl.sum((_chunk_rows(row_ET, c, T, E, TB, BE) >= 0).to(tl.int32), axis=1), 0))


@triton.jit(do_not_specialize=["T", "rows"])
def _token_rows_kernel(row_ET, chunk_counts, idx_TK, expert_offsets_E1, token_offsets_T1, rows_by_token_R, token_idx_R,
                       expert_idx_R, scores_R, pick_R, T, rows, E: tl.constexpr, K: tl.constexpr, TB: tl.constexpr,
                       BE: tl.constexpr, KP: tl.constexpr, NCHP: tl.constexpr, PAD: tl.constexpr):
    """Chunk c of TB tokens: each token's rows in expert order (so row order, as build_plan's stable sort by token
    lists them) from the offset the earlier chunks' counts give, its token offsets, and the top-K pick (t * K + k)
    of each of its kept TC rows. Then PAD of the padding rows past the live ones: expert E, token 0, gate 0, pick
    -1, listed last by token (sonic/routing/plan.py)."""
    c = tl.program_id(0)
    t = c * TB + tl.arange(0, TB)
    row = _chunk_rows(row_ET, c, T, E, TB, BE)
    kept = (row >= 0).to(tl.int32)
    n = tl.sum(kept, axis=1)
    j = tl.arange(0, NCHP)
    base = tl.sum(tl.load(chunk_counts + j, mask=j < c, other=0), axis=0)
    incl = base + tl.cumsum(n, axis=0)
    tl.store(token_offsets_T1 + 1 + t, incl, mask=t < T)
    dst = (incl - n)[:, None] + tl.cumsum(kept, axis=1) - kept
    tl.store(rows_by_token_R + dst, row, mask=kept != 0)
    kk = tl.arange(0, KP)
    pm = (t < T)[:, None] & (kk < K)[None, :]
    pick = t.to(tl.int64)[:, None] * K + kk[None, :]
    pick_row = tl.load(row_ET + tl.load(idx_TK + pick, mask=pm, other=0) * T + t[:, None], mask=pm, other=-1)
    tl.store(pick_R + pick_row, pick.to(tl.int32), mask=pick_row >= 0)
    live = tl.load(expert_offsets_E1 + E)
    r = live + c * PAD + tl.arange(0, PAD)
    pm = r < rows
    tl.store(token_idx_R + r, tl.zeros_like(r), mask=pm)
    tl.store(expert_idx_R + r, tl.zeros_like(r) + E, mask=pm)
    tl.store(scores_R + r, tl.zeros((PAD,), tl.float32), mask=pm)
    tl.store(pick_R + r, tl.zeros_like(r) - 1, mask=pm)
    tl.store(rows_by_token_R + r, r, mask=pm)


def keep_rows(key_ET: Tensor, prob_ET: Tensor, counts_E: Tensor, idx_TK: Tensor, residual_E: Tensor | None,
              uniform_E: Tensor | None, tile: int, mode: str, rows: int) -> list[Tensor]:
    """From the ranking keys and P's bits (int32, E x T) and f_e (counts_E): [scores_R, token_idx_R, expert_idx_R,
    pick_R, expert_offsets_E1, token_offsets_T1, rows_by_token_R, f_e, c_e] of the rounded plan padded to `rows`
    (module docstring). Under stochastic rounding `uniform_E` holds the draw, under balance `residual_E` the
    residual."""
    assert mode in MODES, mode
    E, T = key_ET.shape
    K = idx_TK.shape[1]
    dev = key_ET.device
    tb = token_tile(E)
    nch = triton.cdiv(T, tb)
    i32 = lambda n: _alloc((n,), torch.int32, dev)  # noqa: E731
    scores_R, token_idx_R, expert_idx_R, pick_R, rows_by_token_R = _alloc((rows,), torch.float32, dev), *(
        i32(rows) for _ in range(4))
    expert_offsets_E1, token_offsets_T1, chunk_counts = i32(E + 1), i32(T + 1), i32(max(nch, 1))
    topk_counts_E, rounded_E = (_alloc((E,), torch.int64, dev) for _ in range(2))
    row_ET = _alloc((E, T), torch.int32, dev)
    be = max(16, triton.next_power_of_2(E))
    launch(_round_kernel, (1,))(counts_E, counts_E if residual_E is None else residual_E,
                                counts_E if uniform_E is None else uniform_E, topk_counts_E, rounded_E,
                                expert_offsets_E1, token_offsets_T1, T, E=E, TILE=tile, MODE=MODES[mode], BE=be,
                                num_warps=4)
    if T:
        launch(_keep_kernel, (E,))(key_ET, prob_ET, topk_counts_E, rounded_E, expert_offsets_E1, token_idx_R,
                                   expert_idx_R, scores_R, pick_R, row_ET, T, RESIDENT=T <= _RESIDENT_T,
                                   ROW=max(16, triton.next_power_of_2(min(T, _RESIDENT_T))),
                                   CHUNK=min(_CHUNK, max(16, triton.next_power_of_2(T))), num_warps=16)
        launch(_chunk_counts_kernel, (nch,))(row_ET, chunk_counts, T, E=E, TB=tb, BE=be, num_warps=4)
    pad = max(16, triton.next_power_of_2(triton.cdiv(rows, max(nch, 1))))
    launch(_token_rows_kernel, (max(nch, 1),))(row_ET, chunk_counts, idx_TK, expert_offsets_E1, token_offsets_T1,
                                               rows_by_token_R, token_idx_R, expert_idx_R, scores_R, pick_R, T, rows,
                                               E=E, K=K, TB=tb, BE=be, KP=max(2, triton.next_power_of_2(K)),
                                               NCHP=max(16, triton.next_power_of_2(nch)), PAD=pad, num_warps=4)
    return [scores_R, token_idx_R, expert_idx_R, pick_R, expert_offsets_E1, token_offsets_T1, rows_by_token_R,
            topk_counts_E, rounded_E]
