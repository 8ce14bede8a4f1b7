"""Token rounding's selection and plan in Triton kernels: the last three launches of the triton routing backend's
`route_token_rounding` (sonic/kernels/triton/routing.py), with the semantics of the torch backend's
(sonic/routing/token_rounding.py: rounding rules, ranking, padding).

Expert e keeps the first c_e tokens of its ranking: its top-K (TC) picks by gate, then the others (EC) by P,
ties by P, then token (step 3 of that module's docstring). The select kernel before these writes the ranking keys
as int32, experts x tokens (a TC key is its gate's bits, an EC key P's bits shifted below every TC key: the
class order and each class's float order in one integer) and P's bits; the chunk scan gives f_e. Then:
  _round_kernel       one program: c_e from f_e by the rounding rule, the expert offsets (the exclusive sum of
                      the c_e), and the per-chunk row counters zeroed
  _keep_kernel        per expert: the c_e-th key of its ranking by a radix select (four 8-bit digit histograms
                      over the row, held in registers up to 16384 tokens), then the same on P among the keys tied
                      with it (only when a tie straddles c_e); its kept tokens are written in token order from its
                      first row (token, expert, gate, and which top-K pick a TC row is), every token's row id (or
                      -1) in an experts x tokens map, and its kept rows counted per chunk of tokens
  _token_rows_kernel  per chunk of tokens: its tokens' rows in expert order (rows_by_token: no sort by token), the
                      token offsets from the chunk counters, and a share of the padding rows past the live ones
No sort, no histogram over T x E, no host sync: the rows are padded to a bound (sonic/routing/plan.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonic.kernels.triton import launch

EC_SHIFT = 0x7F800001  # EC keys are P's bits minus this: below every TC key (a gate's bits, >= 0)
_NO_KEY = tl.constexpr(0x7FFFFFFF)  # above every key: an expert that keeps nothing
MODES = {"nearest": 0, "stochastic": 1, "balance": 2, "up": 3, "down": 4}  # nearest_score: the torch selection
_RESIDENT_T = 16384  # up to this many tokens an expert's row stays in registers through the radix passes
_CHUNK = 4096  # beyond, the row is read in blocks of this many tokens per pass
_KEEP_WARPS = 16  # the keep kernel's warps on a resident row of more than 4096 tokens


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer a kernel here writes is allocated here (tests poison it to catch unwritten output)."""
    return torch.empty(shape, dtype=dtype, device=device)


def token_tile(E: int) -> int:
    """Tokens per program of the token-rows kernel (and per chunk counter of the keep kernel)."""
    return max(1, min(64, 4096 // max(16, triton.next_power_of_2(E))))


@triton.jit(do_not_specialize=["T", "NCH"])
def _round_kernel(f_E, residual_E, uniform_E, topk_counts_E, rounded_E, expert_offsets_E1, token_offsets_T1,
                  chunk_counts, T, NCH, E: tl.constexpr, TILE: tl.constexpr, MODE: tl.constexpr, BE: tl.constexpr,
                  BC: tl.constexpr):
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
    for start in range(0, NCH, BC):
        j = start + tl.arange(0, BC)
        tl.store(chunk_counts + j, tl.zeros((BC,), tl.int32), mask=j < NCH)


@triton.jit
def _ordered(k, p, USE_P: tl.constexpr):
    """What a radix pass orders by, as int64 in [0, 2^32): the key (int32, offset to unsigned order) or P's bits."""
    if USE_P:
        return p.to(tl.int64)
    return k.to(tl.int64) + 2147483648


@triton.jit
def _block_digits(k, p, m, kv, prefix, SHIFT: tl.constexpr, USE_P: tl.constexpr, BLOCK: tl.constexpr):
    """The 256-bin histogram of the 8-bit digit at SHIFT of the values under mask m whose higher digits are
    prefix's (with USE_P, among the tokens at key kv). Unmatched values go to bin 0 and come off it."""
    v = _ordered(k, p, USE_P)
    if SHIFT < 24:
        m = m & ((v >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
    if USE_P:
        m = m & (k == kv)
    h = tl.histogram(tl.where(m, (v >> SHIFT) & 255, 0).to(tl.int32), 256)
    return h - tl.where(tl.arange(0, 256) == 0, BLOCK - tl.sum(m.to(tl.int32), axis=0), 0)


@triton.jit
def _digit_counts(key_T, prob_T, T, k_row, p_row, kv, prefix, SHIFT: tl.constexpr, USE_P: tl.constexpr,
                  RESIDENT: tl.constexpr, BLOCK: tl.constexpr):
    """_block_digits over a row of T tokens: the registers k_row/p_row (RESIDENT), else blocks of key_T/prob_T."""
    if RESIDENT:
        h = _block_digits(k_row, p_row, tl.arange(0, BLOCK) < T, kv, prefix, SHIFT, USE_P, BLOCK)
    else:
        h = tl.zeros((256,), tl.int32)
        for start in range(0, T, BLOCK):
            t = start + tl.arange(0, BLOCK)
            m = t < T
            k = tl.load(key_T + t, mask=m, other=0)
            p = tl.load(prob_T + t, mask=m, other=0)
            h += _block_digits(k, p, m, kv, prefix, SHIFT, USE_P, BLOCK)
    return h


@triton.jit
def _radix_select(key_T, prob_T, T, need, kv, k_row, p_row, USE_P: tl.constexpr, RESIDENT: tl.constexpr,
                  BLOCK: tl.constexpr):
    """The need-th largest value (_ordered) of the row (with USE_P, of P among the tokens at key kv), one 8-bit
    digit a pass from the top: (the value, how many of the tokens equal to it are within the first need, how many
    equal it)."""
    prefix = tl.zeros((), tl.int64)
    bins = tl.arange(0, 256)
    tied = tl.zeros((), tl.int32)
    for i in tl.static_range(4):
        h = _digit_counts(key_T, prob_T, T, k_row, p_row, kv, prefix, 24 - 8 * i, USE_P, RESIDENT, BLOCK)
        at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # tokens with this digit or a higher one
        b = tl.sum((at_or_above >= need).to(tl.int32), axis=0) - 1
        need -= tl.sum(tl.where(bins > b, h, 0), axis=0)
        tied = tl.sum(tl.where(bins == b, h, 0), axis=0)
        prefix = prefix | (b.to(tl.int64) << (24 - 8 * i))
    return prefix, need, tied


@triton.jit(do_not_specialize=["T"])
def _keep_kernel(key_ET, prob_ET, rounded_E, expert_offsets_E1, idx_TK, token_idx_R, expert_idx_R, scores_R, pick_R,
                 row_ET, chunk_counts, T, K: tl.constexpr, TB: tl.constexpr, RESIDENT: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program e: its first c_e tokens by key desc, P desc, token asc, written in token order from its first row:
    the token, e, the gate (a TC key's bits, else P's) and the top-K pick (t * K + k) of a TC row (-1 for EC);
    row_ET[e] = each token's row or -1; per chunk of TB tokens, its kept rows added to chunk_counts."""
    e = tl.program_id(0)
    c = tl.load(rounded_E + e).to(tl.int32)
    key_T = key_ET + e.to(tl.int64) * T
    prob_T = prob_ET + e.to(tl.int64) * T
    k_row = 0
    p_row = 0
    if RESIDENT:  # one load; the radix passes then run on registers
        t = tl.arange(0, BLOCK)
        k_row = tl.load(key_T + t, mask=t < T, other=0)
        p_row = tl.load(prob_T + t, mask=t < T, other=0)
    kv = tl.full((), _NO_KEY, tl.int32)  # keep the tokens above (kv, pv), and `room` of those at it, by token
    pv = tl.full((), -1, tl.int32)
    room = tl.zeros((), tl.int32)
    if c > 0:
        kx, need, tied = _radix_select(key_T, prob_T, T, c, 0, k_row, p_row, False, RESIDENT, BLOCK)
        kv = (kx - 2147483648).to(tl.int32)
        if tied > need:  # a tie straddles c_e: rank the tokens at kv by P
            px, room, _ = _radix_select(key_T, prob_T, T, need, kv, k_row, p_row, True, RESIDENT, BLOCK)
            pv = px.to(tl.int32)
        else:  # every token at kv is kept
            pv = tl.full((), -1, tl.int32)
    first = tl.load(expert_offsets_E1 + e)
    written = tl.zeros((), tl.int32)
    tied_seen = tl.zeros((), tl.int32)
    chunks = tl.arange(0, BLOCK // TB)
    for start in range(0, T, BLOCK):
        t = start + tl.arange(0, BLOCK)
        m = t < T
        k = tl.load(key_T + t, mask=m, other=0)
        p = tl.load(prob_T + t, mask=m, other=0)
        tie = (m & (k == kv) & (p == pv)).to(tl.int32)
        keep = m & ((k > kv) | ((k == kv) & (p > pv)))
        keep = keep | ((tie != 0) & (tied_seen + tl.cumsum(tie, axis=0) - tie < room))
        ki = keep.to(tl.int32)
        row = first + written + tl.cumsum(ki, axis=0) - ki
        tc = keep & (k >= 0)
        slot = tl.zeros((BLOCK,), tl.int32)
        for j in tl.static_range(K):
            ij = tl.load(idx_TK + t.to(tl.int64) * K + j, mask=tc, other=-1)
            slot = tl.where(ij == e, j, slot)
        tl.store(token_idx_R + row, t, mask=keep)
        tl.store(expert_idx_R + row, tl.zeros_like(row) + e, mask=keep)
        tl.store(scores_R + row, tl.where(k >= 0, k, p).to(tl.float32, bitcast=True), mask=keep)
        tl.store(pick_R + row, tl.where(tc, t * K + slot, -1), mask=keep)
        tl.store(row_ET + e.to(tl.int64) * T + t, tl.where(keep, row, -1), mask=m)
        local = tl.where(keep, (t - start) // TB, 0)
        h = tl.histogram(local, BLOCK // TB)
        h -= tl.where(chunks == 0, BLOCK - tl.sum(ki, axis=0), 0)
        tl.atomic_add(chunk_counts + start // TB + chunks, h, mask=h > 0)  # integer sums: any order, one result
        written += tl.sum(ki, axis=0)
        tied_seen += tl.sum(tie, axis=0)


@triton.jit(do_not_specialize=["T", "rows"])
def _token_rows_kernel(row_ET, chunk_counts, expert_offsets_E1, token_offsets_T1, rows_by_token_R, token_idx_R,
                       expert_idx_R, scores_R, pick_R, T, rows, E: tl.constexpr, TB: tl.constexpr, BE: tl.constexpr,
                       NCHP: tl.constexpr, PAD: tl.constexpr):
    """Chunk c of TB tokens: each token's rows in expert order (so row order, as build_plan's stable sort by token
    lists them) from the offset the earlier chunks' counters give, and its token offsets. Then PAD of the padding
    rows past the live ones: expert E, token 0, gate 0, listed last by token (sonic/routing/plan.py)."""
    c = tl.program_id(0)
    t = c * TB + tl.arange(0, TB)
    e = tl.arange(0, BE)
    row = tl.load(row_ET + e.to(tl.int64)[None, :] * T + t[:, None], mask=(t < T)[:, None] & (e < E)[None, :],
                  other=-1)
    kept = (row >= 0).to(tl.int32)
    n = tl.sum(kept, axis=1)
    j = tl.arange(0, NCHP)
    base = tl.sum(tl.load(chunk_counts + j, mask=j < c, other=0), axis=0)
    incl = base + tl.cumsum(n, axis=0)
    tl.store(token_offsets_T1 + 1 + t, incl, mask=t < T)
    dst = (incl - n)[:, None] + tl.cumsum(kept, axis=1) - kept
    tl.store(rows_by_token_R + dst, row, mask=kept != 0)
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
                                expert_offsets_E1, token_offsets_T1, chunk_counts, T, nch, E=E, TILE=tile,
                                MODE=MODES[mode], BE=be, BC=1024, num_warps=4)
    if T:
        resident = T <= _RESIDENT_T
        block = max(16, 2 * tb, triton.next_power_of_2(T)) if resident else max(_CHUNK, 2 * tb)
        launch(_keep_kernel, (E,))(key_ET, prob_ET, rounded_E, expert_offsets_E1, idx_TK, token_idx_R, expert_idx_R,
                                   scores_R, pick_R, row_ET, chunk_counts, T, K=K, TB=tb, RESIDENT=resident,
                                   BLOCK=block, num_warps=_KEEP_WARPS if block >= 8192 else 8)
    pad = max(16, triton.next_power_of_2(triton.cdiv(rows, max(nch, 1))))
    launch(_token_rows_kernel, (max(nch, 1),))(row_ET, chunk_counts, expert_offsets_E1, token_offsets_T1,
                                               rows_by_token_R, token_idx_R, expert_idx_R, scores_R, pick_R, T, rows,
                                               E=E, TB=tb, BE=be, NCHP=max(16, triton.next_power_of_2(nch)),
                                               PAD=pad, num_warps=4)
    return [scores_R, token_idx_R, expert_idx_R, pick_R, expert_offsets_E1, token_offsets_T1, rows_by_token_R,
            topk_counts_E, rounded_E]
