"""Routing kernels: the router's top-K selection with its gates and loss statistics, and the RoutingPlan
built on device with no host sync. The `triton` routing backend (routing.backend, sonic/routing/backends.py);
sonic/routing/token_choice.py is the torch backend that defines the semantics.

select_topk (one kernel forward, one backward, behind the custom ops sonic::select_topk[_backward]):
per token, from the router logits, in fp32: logsumexp (lse, for the z-loss and the softmax), the full
softmax summed over the tokens (probsum, for the aux loss: per program, then summed in a fixed order),
the top-K of logits + expert bias (ties to the lower expert index), and the gates from the unbiased
logits (softmax over the K picks, or the full softmax at the picks, optionally renormalised). Its
backward recomputes the softmax from the logits and lse and writes d logits in one pass: the gates',
the aux loss's (through probsum) and the z-loss's (through lse) gradients together.

plan_from_topk is a two-level counting sort: tokens are cut into chunks of BT; per chunk the
pairs are counted per expert (integer atomics), a scan over chunks gives each (chunk,
expert) its first row, and each chunk sorts its own (expert, token) keys in registers to
rank its pairs within an expert. Rows come out sorted by expert then token, exactly as
build_plan's argsort would, with a cost independent of E.

prefix_centred_logits[_backward] (routing.input_centring=prefix): the router's centred logits, in
sonic/kernels/triton/centring.py. prefix_standardise[_backward] (routing.logit_norm=prefix): the logits
standardised per expert over the earlier positions, in sonic/kernels/triton/logit_norm.py.

route_token_rounding (routing.method=token_rounding): the select kernel also writes the ranking keys, the chunk scan
gives f_e, and sonic/kernels/triton/rounding.py's four kernels round the counts, keep each expert's best c_e
tokens and list the rows by token; one op, whose backward is the select backward with the EC rows' gradient on P.
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonic.kernels.triton import launch, rounding
from sonic.kernels.triton.centring import prefix_centred_logits, prefix_centred_logits_backward  # noqa: F401 (its centring)
from sonic.kernels.triton.logit_norm import prefix_standardise, prefix_standardise_backward  # noqa: F401 (its logit norm)
from sonic.ops import DualOp
from sonic.routing import token_rounding
from sonic.routing.plan import RoutingPlan, TopK

ORDERS = {"topk_softmax": 0, "softmax_topk": 1}
# this backend's ops launch their kernels through sonic.kernels.triton.launch: torch.compile may trace them (sonic/ops.py)
TRACED_OPS = True


def unavailable_reason(device: torch.device) -> str | None:
    from sonic.kernels.triton import unavailable_reason as reason

    return reason(device)


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer a kernel writes is allocated here (tests poison it to catch unwritten output)."""
    return torch.empty(shape, dtype=dtype, device=device)


# the select kernel's top-K by one bitonic top-K of packed keys from this K on, by K rounds of (max, argmin) below:
# on an H200 sorting won at E 256, K 16 and lost at E 512, K 10, at E 128, K 8 and at E 64, K 4
# (bench/results/2026-11-25-h200-select-sort-ab.json)
SORT_FROM_K = 16
SCAN_E, SCAN_C = 16, 256  # the chunk scan's experts per program and chunks per step
_EC_SHIFT = rounding.EC_SHIFT  # token rounding's EC keys: P's bits minus this (a constexpr, rounding.py)


def _tiles(E: int, K: int) -> dict:
    be = max(16, triton.next_power_of_2(E))
    return dict(BE=be, BT=max(1, min(64, 2048 // be)), KP=max(2, triton.next_power_of_2(K)),
                num_warps=4 if be <= 1024 else 8)


@triton.jit
def _softmax_rows(logits_TE, t, e, T, E: tl.constexpr):
    """(x, P, lse, row max, row sum of exp(x - max), row mask) of a tile of tokens: logits in fp32, -inf
    padding. P = exp(x - max) / sum."""
    tm = t < T
    em = e < E
    x = tl.load(logits_TE + t.to(tl.int64)[:, None] * E + e[None, :], mask=tm[:, None] & em[None, :],
                other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=1)
    m = tl.where(tm, m, 0.0)
    p = tl.exp(x - m[:, None])
    s = tl.where(tm, tl.sum(p, axis=1), 1.0)  # padding rows: no log(0)
    lse = m + tl.log(s)
    return x, p / s[:, None], lse, m, s, tm


@triton.jit
def _topk_by_sort(sel, e, em, BE: tl.constexpr, KP: tl.constexpr):
    """The KP largest of each row of sel (BT, BE), ties to the lower index, padding columns last: their indices,
    largest first. Each value is a 64-bit key, its fp32 bits made to order as unsigned (sign flipped, or all bits
    for negatives; -0 as +0) above BE - 1 - index, so one bitonic top-KP (tl.topk) orders by value, then index."""
    bits = tl.where(sel == 0.0, 0.0, sel).to(tl.uint32, bitcast=True)
    ordered = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)
    key = (ordered.to(tl.uint64) << 32) | (BE - 1 - e)[None, :].to(tl.uint64)
    key = tl.where(em[None, :], key, 0)  # below every real value's key, -inf's included
    top = tl.topk(key, KP, dim=1)
    return BE - 1 - (top & 0xFFFFFFFF).to(tl.int32)


@triton.jit(do_not_specialize=["T"])
def _select_kernel(logits_TE, bias_E, idx_TK, gates_TK, lse_T, probsum_CE, counts_CE, key_ET, prob_ET, T,
                   E: tl.constexpr, K: tl.constexpr, ORDER: tl.constexpr, RENORM: tl.constexpr, COUNT: tl.constexpr,
                   KEYS: tl.constexpr, SUB: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, KP: tl.constexpr,
                   SORT: tl.constexpr):
    """Chunk c = SUB tiles of BT tokens. Per token: the K largest of logits + bias, ties to the lower index,
    then the gates: K rounds of (max, lowest index attaining it), two reductions over the tile per pick, or
    with SORT one bitonic top-KP of packed keys (_topk_by_sort). Per chunk (no atomics, so deterministic): the
    softmax summed over its tokens and, with COUNT, its picks per expert (what the plan's counting sort
    scans). A pick's logit is loaded again (from L1) rather than reduced out of the tile. With KEYS, token
    rounding's ranking keys and P's bits, experts x tokens (sonic/kernels/triton/rounding.py)."""
    c = tl.program_id(0)
    e = tl.arange(0, BE)
    em = e < E
    bias = tl.load(bias_E + e, mask=em, other=0.0)
    kk = tl.arange(0, KP)
    probsum = tl.zeros((BE,), tl.float32)
    counts = tl.zeros((BE,), tl.int32)
    for sub in range(SUB):
        t = (c * SUB + sub) * BT + tl.arange(0, BT)
        x, P, lse, row_max, row_sum, tm = _softmax_rows(logits_TE, t, e, T, E)
        tl.store(lse_T + t, lse, mask=tm)
        probsum += tl.sum(tl.where(tm[:, None], P, 0.0), axis=0)
        sel = x + bias[None, :]
        if SORT:
            top_i = _topk_by_sort(sel, e, em, BE, KP)
            if COUNT:  # picks past K and rows past T go to bin 0 and come off it
                picked = tm[:, None] & (kk < K)[None, :]
                h = tl.histogram(tl.reshape(tl.where(picked, top_i, 0), [BT * KP]), BE)
                counts += h - tl.where(e == 0, BT * KP - tl.sum(tl.where(picked, 1, 0)), 0)
        else:
            taken = (~em)[None, :] | (t < 0)[:, None]  # padding columns never win
            top_i = tl.zeros((BT, KP), tl.int32)
            for k in tl.static_range(K):
                sv = tl.where(taken, float("-inf"), sel)
                m = tl.max(sv, axis=1)
                i = tl.min(tl.where((sv == m[:, None]) & ~taken, e[None, :], BE), axis=1)
                top_i = tl.where(kk[None, :] == k, i[:, None], top_i)
                taken = taken | (e[None, :] == i[:, None])
            if COUNT:
                counts += tl.sum(tl.where(taken & em[None, :] & tm[:, None], 1, 0), axis=0)
        # the unbiased logit of each pick
        top_x = tl.load(logits_TE + t.to(tl.int64)[:, None] * E + top_i, mask=tm[:, None] & (kk < K)[None, :],
                        other=float("-inf")).to(tl.float32)
        if ORDER == 0:  # softmax over the K picked logits
            mx = tl.max(top_x, axis=1)
            g = tl.where(kk[None, :] < K, tl.exp(top_x - mx[:, None]), 0.0)
            g = g / tl.sum(g, axis=1)[:, None]
        else:  # the full softmax at the picks, as P computes it
            g = tl.where(kk[None, :] < K, tl.exp(top_x - row_max[:, None]) / row_sum[:, None], 0.0)
            if RENORM:
                g = g / tl.sum(g, axis=1)[:, None]
        om = tm[:, None] & (kk < K)[None, :]
        out = t.to(tl.int64)[:, None] * K + kk[None, :]
        tl.store(idx_TK + out, top_i.to(tl.int64), mask=om)
        tl.store(gates_TK + out, g, mask=om)
        if KEYS:  # a TC key is its gate's bits, an EC key P's bits shifted below every TC key
            key = P.to(tl.int32, bitcast=True) - _EC_SHIFT
            for k in tl.static_range(K):
                ik = tl.sum(tl.where(kk[None, :] == k, top_i, 0), axis=1)
                gk = tl.sum(tl.where(kk[None, :] == k, g, 0.0), axis=1)
                key = tl.where(e[None, :] == ik[:, None], gk.to(tl.int32, bitcast=True)[:, None], key)
            km = tm[:, None] & em[None, :]
            dst = e.to(tl.int64)[None, :] * T + t[:, None]
            tl.store(key_ET + dst, key, mask=km)
            tl.store(prob_ET + dst, P.to(tl.int32, bitcast=True), mask=km)
    tl.store(probsum_CE + c.to(tl.int64) * E + e, probsum, mask=em)
    if COUNT:
        tl.store(counts_CE + c.to(tl.int64) * E + e, counts, mask=em)


@triton.jit(do_not_specialize=["T"])
def _select_backward_kernel(logits_TE, idx_TK, gates_TK, lse_T, dgates_TK, dprobsum_E, dlse_T, dP_TE, dlogits_TE, T,
                            E: tl.constexpr, K: tl.constexpr, ORDER: tl.constexpr, RENORM: tl.constexpr,
                            DP: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, KP: tl.constexpr):
    """d logits = P * (u - <P, u>) + w, where u = dL/dP (the aux loss's probsum gradient, the gates' under
    softmax_topk, and with DP a gradient on P itself: token rounding's EC rows) and w collects what does not go
    through the full softmax (the gates under topk_softmax: a softmax over the K picks; the z-loss through lse:
    dlse * P)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.arange(0, BE)
    tm = t < T
    em = e < E
    x = tl.load(logits_TE + t.to(tl.int64)[:, None] * E + e[None, :], mask=tm[:, None] & em[None, :],
                other=float("-inf")).to(tl.float32)
    lse = tl.load(lse_T + t, mask=tm, other=0.0)
    P = tl.exp(x - lse[:, None])
    P = tl.where(tm[:, None] & em[None, :], P, 0.0)
    kk = tl.arange(0, KP)
    km = tm[:, None] & (kk < K)[None, :]
    pk = t.to(tl.int64)[:, None] * K + kk[None, :]
    idx = tl.load(idx_TK + pk, mask=km, other=-1).to(tl.int32)
    gate = tl.load(gates_TK + pk, mask=km, other=0.0)
    dg = tl.load(dgates_TK + pk, mask=km, other=0.0).to(tl.float32)
    u = tl.load(dprobsum_E + e, mask=em, other=0.0)[None, :] + tl.zeros((BT, BE), tl.float32)
    if DP:
        u += tl.load(dP_TE + t.to(tl.int64)[:, None] * E + e[None, :], mask=tm[:, None] & em[None, :], other=0.0)
    w = tl.load(dlse_T + t, mask=tm, other=0.0)[:, None] * P
    if ORDER == 0:  # gate_k = softmax over the picked logits: d x_k = gate_k (dg_k - <gate, dg>)
        dpick = gate * (dg - tl.sum(gate * dg, axis=1)[:, None])
    elif RENORM:  # gate_k = P_k / S with S the picks' P summed: d P_k = (dg_k - <gate, dg>) / S
        S = tl.zeros((BT,), tl.float32)
        for k in tl.static_range(K):
            col = tl.sum(tl.where(kk[None, :] == k, idx, 0), axis=1)
            S += tl.sum(tl.where(e[None, :] == col[:, None], P, 0.0), axis=1)
        dpick = (dg - tl.sum(gate * dg, axis=1)[:, None]) / tl.where(tm, S, 1.0)[:, None]
    else:  # gate_k = P_k
        dpick = dg
    for k in tl.static_range(K):
        col = tl.sum(tl.where(kk[None, :] == k, idx, 0), axis=1)
        val = tl.where(e[None, :] == col[:, None], tl.sum(tl.where(kk[None, :] == k, dpick, 0.0), axis=1)[:, None], 0.0)
        if ORDER == 0:
            w += val
        else:
            u += val
    d = P * (u - tl.sum(P * u, axis=1)[:, None]) + w
    tl.store(dlogits_TE + t.to(tl.int64)[:, None] * E + e[None, :], d, mask=tm[:, None] & em[None, :])


def _chunks(E: int, K: int) -> dict:
    """The select kernel's tiles and chunk: a chunk of CT = SUB * BT tokens is also the plan's sort unit
    (CT * KP keys sorted in registers)."""
    tiles = _tiles(E, K)
    ct = max(tiles["BT"], 512 // tiles["KP"])
    return dict(tiles, SUB=ct // tiles["BT"])


def _select_launch(logits_TE: Tensor, bias_E: Tensor, k: int, order: str, renormalize: bool, count: bool,
                   keys: tuple[Tensor, Tensor] | None = None):
    """The select kernel's outputs; with `keys`, (key_ET, prob_ET) to write token rounding's ranking keys into."""
    T, E = logits_TE.shape
    dev = logits_TE.device
    cfg = _chunks(E, k)
    C = triton.cdiv(T, cfg["BT"] * cfg["SUB"])
    idx_TK = _alloc((T, k), torch.int64, dev)
    gates_TK = _alloc((T, k), torch.float32, dev)
    lse_T = _alloc((T,), torch.float32, dev)
    probsum_CE = _alloc((C, E), torch.float32, dev)
    counts_CE = _alloc((C, E), torch.int32, dev) if count else probsum_CE
    if T:
        key_ET, prob_ET = keys or (lse_T, lse_T)
        launch(_select_kernel, (C,))(logits_TE, bias_E, idx_TK, gates_TK, lse_T, probsum_CE, counts_CE, key_ET,
                                     prob_ET, T, E=E, K=k, ORDER=ORDERS[order], RENORM=renormalize, COUNT=count,
                                     KEYS=keys is not None, SORT=k >= SORT_FROM_K, **cfg)
    return idx_TK, gates_TK, lse_T, probsum_CE, counts_CE, cfg


def _select_impl(logits_TE: Tensor, bias_E: Tensor, k: int, order: str, renormalize: bool
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    idx_TK, gates_TK, lse_T, probsum_CE, _, _ = _select_launch(logits_TE, bias_E, k, order, renormalize, False)
    return idx_TK, gates_TK, lse_T, probsum_CE.sum(0)  # a fixed-order sum: deterministic


def _select_fake(logits_TE, bias_E, k, order, renormalize):
    T, E = logits_TE.shape
    f32 = dict(dtype=torch.float32, device=logits_TE.device)
    return (logits_TE.new_empty((T, k), dtype=torch.int64), logits_TE.new_empty((T, k), **f32),
            logits_TE.new_empty((T,), **f32), logits_TE.new_empty((E,), **f32))


def _route_impl(logits_TE: Tensor, bias_E: Tensor, k: int, order: str, renormalize: bool) -> list[Tensor]:
    """select_topk and the plan of its picks in one op: (idx_TK, gates_TK, lse_T, probsum_E) and the plan's
    (token_idx_R, expert_idx_R, order_R, expert_offsets_E1, token_offsets_T1, rows_by_token_R), where
    order_R is each row's position in idx_TK.view(-1). Four launches: select (with per-chunk counts), the
    scan over chunks (with the probsum), the expert offsets, the scatter."""
    T, E = logits_TE.shape
    dev, R = logits_TE.device, T * k
    idx_TK, gates_TK, lse_T, probsum_CE, counts_CE, cfg = _select_launch(logits_TE, bias_E, k, order, renormalize,
                                                                         True)
    base_CE, total_E, probsum_E = _scan_chunks(counts_CE, probsum_CE)
    expert_offsets_E1 = _alloc((E + 1,), torch.int32, dev)
    token_idx_R, expert_idx_R, order_R, rows_by_token_R = (_alloc((R,), torch.int32, dev) for _ in range(4))
    launch(_expert_offsets_kernel, (1,))(total_E, expert_offsets_E1, E=E,
                                         BE=max(16, min(4096, triton.next_power_of_2(E))), num_warps=4)
    if T:
        launch(_scatter_kernel, (counts_CE.shape[0],))(idx_TK, base_CE, expert_offsets_E1, token_idx_R, expert_idx_R,
                                                       order_R, rows_by_token_R, T, E=E, K=k,
                                                       BT=cfg["BT"] * cfg["SUB"], KP=cfg["KP"], num_warps=8)
    token_offsets_T1 = torch.arange(0, R + 1, k, dtype=torch.int32, device=dev)
    return [idx_TK, gates_TK, lse_T, probsum_E, token_idx_R, expert_idx_R, order_R, expert_offsets_E1,
            token_offsets_T1, rows_by_token_R]


def _scan_chunks(counts_CE: Tensor, probsum_CE: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(base_CE, total_E, probsum_E): each (chunk, expert)'s picks in the chunks before it, the picks and the softmax
    summed over the chunks (in chunk order: deterministic)."""
    C, E = counts_CE.shape
    dev = counts_CE.device
    base_CE = _alloc((C, E), torch.int32, dev)
    total_E = _alloc((E,), torch.int32, dev)
    probsum_E = _alloc((E,), torch.float32, dev)
    # 16 experts a program, 256 chunks a step: the scan is latency-bound (one program over 128 experts in steps of
    # 32 chunks took 37 us at 30B's 512 chunks on an H200)
    launch(_scan_chunks_kernel, (triton.cdiv(E, SCAN_E),))(counts_CE, probsum_CE, base_CE, total_E, probsum_E, C, E=E,
                                                           BC=SCAN_C, BE=SCAN_E, num_warps=4)
    return base_CE, total_E, probsum_E


def _route_fake(logits_TE, bias_E, k, order, renormalize):
    T, E = logits_TE.shape
    i32 = lambda n: logits_TE.new_empty((n,), dtype=torch.int32)  # noqa: E731
    return [*_select_fake(logits_TE, bias_E, k, order, renormalize), i32(T * k), i32(T * k), i32(T * k), i32(E + 1),
            i32(T + 1), i32(T * k)]


@triton.jit(do_not_specialize=["C"])
def _scan_chunks_kernel(counts_CE, probsum_CE, base_CE, total_E, probsum_E, C, E: tl.constexpr, BC: tl.constexpr,
                        BE: tl.constexpr):
    """base[c, e] = sum_{c' < c} counts[c', e]; total[e] = sum_c counts[c, e]; probsum[e] = sum_c probsum[c, e]
    (in chunk order: deterministic)."""
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < E
    carry = tl.zeros((BE,), tl.int32)
    psum = tl.zeros((BE,), tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        m = (c < C)[:, None] & em[None, :]
        ptr = c.to(tl.int64)[:, None] * E + e[None, :]
        v = tl.load(counts_CE + ptr, mask=m, other=0)
        incl = tl.cumsum(v, axis=0)
        tl.store(base_CE + ptr, carry[None, :] + incl - v, mask=m)
        carry += tl.sum(v, axis=0)
        psum += tl.sum(tl.load(probsum_CE + ptr, mask=m, other=0.0), axis=0)
    tl.store(total_E + e, carry, mask=em)
    tl.store(probsum_E + e, psum, mask=em)


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
    e = tl.load(idx_TK + t64[:, None] * K + k[None, :], mask=m, other=0).to(tl.int32)  # int64 ids in
    slot = tl.zeros((BT, KP), tl.int32)
    for k2 in tl.static_range(K):
        e2 = tl.load(idx_TK + t64 * K + k2, mask=t < T, other=0).to(tl.int32)
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


def _select_backward_impl(logits_TE: Tensor, idx_TK: Tensor, gates_TK: Tensor, lse_T: Tensor, dgates_TK: Tensor,
                          dprobsum_E: Tensor, dlse_T: Tensor, order: str, renormalize: bool) -> Tensor:
    return _select_backward_launch(logits_TE, idx_TK, gates_TK, lse_T, dgates_TK, dprobsum_E, dlse_T, None, order,
                                   renormalize)


def _select_backward_launch(logits_TE: Tensor, idx_TK: Tensor, gates_TK: Tensor, lse_T: Tensor, dgates_TK: Tensor,
                            dprobsum_E: Tensor, dlse_T: Tensor, dP_TE: Tensor | None, order: str,
                            renormalize: bool) -> Tensor:
    """d logits from the gradients of the gates, probsum and lse, and (dP_TE) of the full softmax P itself."""
    T, E = logits_TE.shape
    K = idx_TK.shape[1]
    dlogits_TE = _alloc((T, E), logits_TE.dtype, logits_TE.device)
    if T:
        tiles = _tiles(E, K)
        launch(_select_backward_kernel, (triton.cdiv(T, tiles["BT"]),))(
            logits_TE, idx_TK, gates_TK, lse_T, dgates_TK.contiguous(), dprobsum_E.float().contiguous(),
            dlse_T.float().contiguous(), dlogits_TE if dP_TE is None else dP_TE, dlogits_TE, T, E=E, K=K,
            ORDER=ORDERS[order], RENORM=renormalize, DP=dP_TE is not None, **tiles)
    return dlogits_TE


def _select_backward_fake(logits_TE, idx_TK, gates_TK, lse_T, dgates_TK, dprobsum_E, dlse_T, order, renormalize):
    return torch.empty_like(logits_TE)


_select = DualOp("select_topk", _select_impl, _select_fake)
_route = DualOp("route_topk", _route_impl, _route_fake)
_select_backward = DualOp("select_topk_backward", _select_backward_impl, _select_backward_fake)


def _setup(ctx, inputs, output):
    logits_TE, _, _, order, renormalize = inputs
    idx_TK, gates_TK, lse_T = output[:3]
    ctx.save_for_backward(logits_TE, idx_TK, gates_TK, lse_T)
    ctx.order, ctx.renormalize = order, renormalize


def _backward(backward_op, ctx, grads):
    """Both ops' backward: the gradients of (gates, lse, probsum) -> d logits; the rest has none."""
    logits_TE, idx_TK, gates_TK, lse_T = ctx.saved_tensors
    dgates_TK, dlse_T, dprobsum_E = grads[1:4]
    zeros = lambda g, like: torch.zeros_like(like) if g is None else g  # noqa: E731
    dlogits_TE = backward_op(logits_TE, idx_TK, gates_TK, lse_T, zeros(dgates_TK, gates_TK),
                                  zeros(dprobsum_E, lse_T.new_empty(logits_TE.shape[1])), zeros(dlse_T, lse_T),
                                  ctx.order, ctx.renormalize)
    return dlogits_TE, None, None, None, None


_select.register_autograd(lambda op, ctx, *grads: _backward(op, ctx, grads), _setup, _select_backward)
_route.register_autograd(lambda op, ctx, grads: _backward(op, ctx, grads), _setup, _select_backward)


def _check(logits_TE: Tensor, k: int) -> None:
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE must be (tokens, experts), got {tuple(logits_TE.shape)}")
    if not 1 <= k <= logits_TE.shape[1]:
        raise ValueError(f"top_k={k} must be between 1 and the number of experts {logits_TE.shape[1]}")


def select_topk(logits_TE: Tensor, bias_E: Tensor, k: int, order: str, renormalize: bool) -> TopK:
    """The torch backend's sonic.routing.token_choice.select_topk, fused: see the module docstring."""
    _check(logits_TE, k)
    idx_TK, gates_TK, lse_T, probsum_E = _select(logits_TE.contiguous(), bias_E.float().contiguous(), k, order,
                                                renormalize, traced=TRACED_OPS)
    return TopK(idx_TK, gates_TK, probsum_E, lse_T)


def route_topk(logits_TE: Tensor, bias_E: Tensor, k: int, order: str, renormalize: bool) -> tuple[TopK, RoutingPlan]:
    """select_topk and the plan of its picks (the same as sonic.routing.plan.plan_from_topk's), on device
    with no host sync, in one op."""
    _check(logits_TE, k)
    idx_TK, gates_TK, lse_T, probsum_E, token_idx_R, expert_idx_R, order_R, expert_offsets_E1, token_offsets_T1, \
        rows_by_token_R = _route(logits_TE.contiguous(), bias_E.float().contiguous(), k, order, renormalize,
                                 traced=TRACED_OPS)
    # index_select by a permutation: its backward is an index_add without collisions (no sort)
    plan = RoutingPlan(token_idx_R=token_idx_R, expert_idx_R=expert_idx_R,
                       scores_R=gates_TK.reshape(-1).index_select(0, order_R), expert_offsets_E1=expert_offsets_E1,
                       token_offsets_T1=token_offsets_T1, rows_by_token_R=rows_by_token_R)
    return TopK(idx_TK, gates_TK, probsum_E, lse_T), plan


def _route_rounding_impl(logits_TE: Tensor, bias_E: Tensor, k: int, order: str, renormalize: bool, tile: int,
                         mode: str, residual_E: Tensor | None, uniform_E: Tensor | None, rows: int) -> list[Tensor]:
    """select_topk and token rounding's plan of its picks in one op, six launches: select (with its picks per chunk
    and the ranking keys), the chunk scan (f_e, probsum), and rounding.keep_rows' four. (idx_TK, gates_TK, lse_T,
    probsum_E) and keep_rows' list."""
    T, E = logits_TE.shape
    key_ET, prob_ET = (_alloc((E, T), torch.int32, logits_TE.device) for _ in range(2))
    idx_TK, gates_TK, lse_T, probsum_CE, counts_CE, _ = _select_launch(logits_TE, bias_E, k, order, renormalize, True,
                                                                       keys=(key_ET, prob_ET))
    _, total_E, probsum_E = _scan_chunks(counts_CE, probsum_CE)
    return [idx_TK, gates_TK, lse_T, probsum_E,
            *rounding.keep_rows(key_ET, prob_ET, total_E, idx_TK, residual_E, uniform_E, tile, mode, rows)]


def _route_rounding_fake(logits_TE, bias_E, k, order, renormalize, tile, mode, residual_E, uniform_E, rows):
    T, E = logits_TE.shape
    new = lambda n, dtype: logits_TE.new_empty((n,), dtype=dtype)  # noqa: E731
    return [*_select_fake(logits_TE, bias_E, k, order, renormalize), new(rows, torch.float32),
            *(new(rows, torch.int32) for _ in range(3)), new(E + 1, torch.int32), new(T + 1, torch.int32),
            new(rows, torch.int32), new(E, torch.int64), new(E, torch.int64)]


def _route_rounding_backward_impl(logits_TE: Tensor, idx_TK: Tensor, gates_TK: Tensor, lse_T: Tensor,
                                  dgates_TK: Tensor, dprobsum_E: Tensor, dlse_T: Tensor, dscores_R: Tensor,
                                  token_idx_R: Tensor, expert_idx_R: Tensor, pick_R: Tensor, order: str,
                                  renormalize: bool) -> Tensor:
    """d logits, where a row's gate is a top-K gate (a TC row, pick_R >= 0: its gradient joins the gates') or P at
    its (token, expert) (an EC row: a gradient on P); padding rows' gradients land in slots of their own, unread."""
    T, E = logits_TE.shape
    TK, TE = idx_TK.numel(), T * E
    extra = torch.zeros(TK + TE + pick_R.numel(), dtype=torch.float32, device=logits_TE.device)
    padding = TK + TE + torch.arange(pick_R.numel(), device=pick_R.device)
    slot_R = torch.where(pick_R >= 0, pick_R.long(), torch.where(
        expert_idx_R < E, TK + token_idx_R.long() * E + expert_idx_R.long(), padding))
    extra.scatter_(0, slot_R, dscores_R.float())  # every slot at most once: deterministic
    return _select_backward_launch(logits_TE, idx_TK, gates_TK, lse_T, dgates_TK + extra[:TK].view_as(dgates_TK),
                                   dprobsum_E, dlse_T, extra[TK:TK + TE].view(T, E), order, renormalize)


def _route_rounding_backward_fake(logits_TE, idx_TK, gates_TK, lse_T, dgates_TK, dprobsum_E, dlse_T, dscores_R,
                                  token_idx_R, expert_idx_R, pick_R, order, renormalize):
    return torch.empty_like(logits_TE)


_route_rounding = DualOp("route_token_rounding", _route_rounding_impl, _route_rounding_fake)
_route_rounding_backward = DualOp("route_token_rounding_backward", _route_rounding_backward_impl,
                                  _route_rounding_backward_fake)


def _setup_rounding(ctx, inputs, output):
    logits_TE, _, _, order, renormalize = inputs[:5]
    idx_TK, gates_TK, lse_T = output[:3]
    token_idx_R, expert_idx_R, pick_R = output[5:8]
    ctx.save_for_backward(logits_TE, idx_TK, gates_TK, lse_T, token_idx_R, expert_idx_R, pick_R)
    ctx.order, ctx.renormalize = order, renormalize


def _backward_rounding(backward_op, ctx, grads):
    """The gradients of (gates, lse, probsum, the rows' gates) -> d logits; the rest has none."""
    logits_TE, idx_TK, gates_TK, lse_T, token_idx_R, expert_idx_R, pick_R = ctx.saved_tensors
    dgates_TK, dlse_T, dprobsum_E, dscores_R = grads[1:5]
    zeros = lambda g, shape: torch.zeros(shape, device=lse_T.device) if g is None else g  # noqa: E731
    dlogits_TE = backward_op(logits_TE, idx_TK, gates_TK, lse_T, zeros(dgates_TK, gates_TK.shape),
                             zeros(dprobsum_E, logits_TE.shape[1]), zeros(dlse_T, lse_T.shape),
                             zeros(dscores_R, pick_R.shape), token_idx_R, expert_idx_R, pick_R, ctx.order,
                             ctx.renormalize)
    return dlogits_TE, *([None] * 9)


_route_rounding.register_autograd(lambda op, ctx, grads: _backward_rounding(op, ctx, grads), _setup_rounding,
                                  _route_rounding_backward)


def route_token_rounding(logits_TE: Tensor, bias_E: Tensor, k: int, order: str, renormalize: bool, tile: int,
                         mode: str, residual_E: Tensor | None) -> tuple[TopK, RoutingPlan, Tensor, Tensor]:
    """The torch backend's route_token_rounding (sonic/routing/token_rounding.py) in one op, on device with no host
    sync (sonic/kernels/triton/rounding.py). The ranking's P is this kernel's softmax (equal to torch's to fp32
    rounding). nearest_score decides c_e from ranked gate sums, which these kernels do not form: it takes the torch
    selection after this backend's top-K."""
    _check(logits_TE, k)
    if mode not in rounding.MODES:
        return token_rounding.route_token_rounding(sys.modules[__name__], logits_TE, bias_E, k, order, renormalize,
                                                   tile, mode, residual_E)
    T, E = logits_TE.shape
    uniform_E = torch.rand(E, device=logits_TE.device) if mode == "stochastic" else None
    idx_TK, gates_TK, lse_T, probsum_E, scores_R, token_idx_R, expert_idx_R, _, expert_offsets_E1, token_offsets_T1, \
        rows_by_token_R, topk_counts_E, rounded_E = _route_rounding(
            logits_TE.contiguous(), bias_E.float().contiguous(), k, order, renormalize, tile, mode, residual_E,
            uniform_E, token_rounding.max_rows(T, k, E, tile, mode), traced=TRACED_OPS)
    plan = RoutingPlan(token_idx_R=token_idx_R, expert_idx_R=expert_idx_R, scores_R=scores_R,
                       expert_offsets_E1=expert_offsets_E1, token_offsets_T1=token_offsets_T1,
                       rows_by_token_R=rows_by_token_R)
    return TopK(idx_TK, gates_TK, probsum_E, lse_T), plan, topk_counts_E, rounded_E
