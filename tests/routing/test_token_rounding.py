"""Token rounding (SonicMoE Algorithm 4) on random and adversarial score matrices.

Count rule under test: every rounded count c_e is a multiple of tile_size, or T when
rounding up would pass T; |c_e - f_e| < tile_size; c_e is one of the two tile multiples
around the top-K count f_e (the up one capped at T).
"""
from __future__ import annotations

import math

import pytest
import torch

from sonic.routing import Router, RoutingConfig, round_counts, select_topk, token_rounding_plan
from sonic.routing.token_rounding import max_rows
from tests.helpers import assert_padding

MODES = ("nearest", "stochastic", "nearest_score", "balance", "up", "down")


def _logits(name: str) -> tuple[torch.Tensor, int, int]:
    """(logits_TE, K, tile) for a named score matrix."""
    gen = torch.Generator().manual_seed(len(name))
    if name == "random":
        return torch.randn(200, 8, generator=gen), 2, 16
    if name == "random_large":
        return torch.randn(1000, 16, generator=gen) * 3, 4, 32
    if name == "all_ties":  # every score equal
        return torch.zeros(100, 8), 2, 16
    if name == "coarse_ties":  # many equal scores within each column
        return torch.randint(0, 3, (150, 6), generator=gen).float(), 2, 16
    if name == "one_expert":  # every token prefers expert 0
        logits = torch.randn(120, 8, generator=gen)
        logits[:, 0] += 20
        return logits, 2, 16
    if name == "fewer_tokens_than_tile":
        return torch.randn(5, 4, generator=gen), 2, 8
    if name == "empty_experts":  # experts 0..2 are never anyone's top-K pick
        logits = torch.randn(90, 8, generator=gen)
        logits[:, :3] -= 30
        return logits, 2, 16
    if name == "k1_topk_softmax":  # every TC gate is 1: dropping must fall back to P_te
        return torch.randn(70, 4, generator=gen), 1, 16
    if name == "sonic_7b":  # the trainer's routing shape (micro-batch 4 x 4096), for the GPU tests
        return torch.randn(16384, 128, generator=gen) * 2, 8, 128
    if name == "over_16k_tokens":  # the triton selection reads rows in blocks past 16384 tokens (GPU tests)
        return torch.randn(20000, 64, generator=gen) * 2, 8, 128
    raise KeyError(name)


MATRICES = ("random", "random_large", "all_ties", "coarse_ties", "one_expert", "fewer_tokens_than_tile",
            "empty_experts", "k1_topk_softmax")


def route(logits_TE, K, tile, mode, order="topk_softmax", renormalize=False, residual_E=None):
    probs_TE = logits_TE.softmax(-1)
    topk = select_topk(logits_TE, torch.zeros(logits_TE.shape[1]), K, order, renormalize)
    if mode == "balance" and residual_E is None:
        residual_E = torch.zeros(logits_TE.shape[1], dtype=torch.int64)
    out = token_rounding_plan(probs_TE, topk.expert_idx_TK, topk.gates_TK, tile, mode, residual_E)
    return probs_TE, topk, out


def kept_tokens(plan, e):
    off = plan.expert_offsets_E1.tolist()
    return plan.token_idx_R[off[e]:off[e + 1]].tolist()


def brute_force_ranking(probs_TE, tc_gate, e):
    """Tokens for expert e by (TC first by gate, then EC by P), ties by P then token: plain Python."""
    T = probs_TE.shape[0]
    key = [tc_gate[(t, e)] if (t, e) in tc_gate else probs_TE[t, e].item() - 1 for t in range(T)]
    key = [float(torch.tensor(k, dtype=torch.float32)) for k in key]  # the fp32 keys the router ranks
    return sorted(range(T), key=lambda t: (-key[t], -probs_TE[t, e].item(), t))


@pytest.mark.parametrize("order,renormalize", [("topk_softmax", False), ("softmax_topk", False),
                                               ("softmax_topk", True)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("matrix", MATRICES)
def test_rounding_properties(matrix, mode, order, renormalize):
    logits_TE, K, M = _logits(matrix)
    T, E = logits_TE.shape
    probs_TE, topk, (plan, f_E, c_E) = route(logits_TE, K, M, mode, order, renormalize)
    tc_gate = {(t, e): g for t, row in enumerate(topk.expert_idx_TK.tolist())
               for e, g in zip(row, topk.gates_TK[t].tolist())}
    assert f_E.tolist() == torch.bincount(topk.expert_idx_TK.reshape(-1), minlength=E).tolist()
    assert plan.counts_E().tolist() == c_E.tolist()
    # sized by the bound, never by the kept count (no host sync); the rows past the live ones are padding
    live = plan.live_rows()
    assert plan.num_rows == max_rows(T, K, E, M, mode) >= live == int(c_E.sum())
    assert_padding(plan)
    key = plan.expert_idx_R[:live].long() * T + plan.token_idx_R[:live].long()
    assert (key[1:] > key[:-1]).all()  # no (token, expert) pair twice
    gate_of_row = dict(zip(zip(plan.token_idx_R[:live].tolist(), plan.expert_idx_R[:live].tolist()),
                           plan.scores_R[:live].tolist()))
    for e in range(E):
        f, c = int(f_E[e]), int(c_E[e])
        down, up = f // M * M, min(math.ceil(f / M) * M, T)
        assert c in (down, up) and c <= T
        assert c % M == 0 or (c == T and math.ceil(f / M) * M > T)
        assert abs(c - f) < M or f % M == 0 and c == f
        kept = kept_tokens(plan, e)
        tc = {t for (t, e_) in tc_gate if e_ == e}
        if c >= f:  # every TC pick of e is kept, the rest are EC pads
            assert tc <= set(kept)
        else:  # only TC picks remain
            assert set(kept) <= tc
        assert set(kept) == set(brute_force_ranking(probs_TE, tc_gate, e)[:c])
        for t in kept:  # TC rows keep their top-K gate, EC pads get the full-softmax probability
            want = tc_gate[(t, e)] if t in tc else probs_TE[t, e].item()
            assert gate_of_row[(t, e)] == pytest.approx(want, rel=1e-6)
    if mode == "up":
        assert (c_E >= f_E).all()
    if mode == "down":
        assert (c_E <= f_E).all()
    if mode == "nearest":
        rem = f_E % M
        expect = torch.where(2 * rem >= M, torch.clamp((f_E + M - 1) // M * M, max=T), f_E // M * M)
        assert c_E.tolist() == expect.tolist()


@pytest.mark.parametrize("matrix", MATRICES)
def test_up_topk_down_order(matrix):
    logits_TE, K, M = _logits(matrix)
    c_up = route(logits_TE, K, M, "up")[2].rounded_E
    f, c_down = route(logits_TE, K, M, "down")[2][1:]
    assert (c_up >= f).all() and (f >= c_down).all()
    for mode in MODES:
        c = route(logits_TE, K, M, mode)[2].rounded_E
        assert ((c_down <= c) & (c <= c_up)).all(), mode


def test_down_equals_token_dropping():
    """down keeps, per expert, its floor(f/M)*M top-K picks with the highest gates."""
    logits_TE, K, M = _logits("random")
    probs_TE, topk, (plan, f_E, c_E) = route(logits_TE, K, M, "down")
    for e in range(logits_TE.shape[1]):
        picks = [(g, t) for t, (row, gates) in enumerate(zip(topk.expert_idx_TK.tolist(), topk.gates_TK.tolist()))
                 for e_, g in zip(row, gates) if e_ == e]
        best = {t for _, t in sorted(picks, key=lambda p: (-p[0], -probs_TE[p[1], e].item(), p[1]))[:int(c_E[e])]}
        assert set(kept_tokens(plan, e)) == best


def test_k1_drops_by_probability_not_token_index():
    """With K=1 and topk_softmax every TC gate is 1; the weakest picks by P_te are dropped."""
    logits_TE, K, M = _logits("k1_topk_softmax")
    probs_TE, topk, (plan, f_E, c_E) = route(logits_TE, K, M, "down")
    for e in range(4):
        picks = (topk.expert_idx_TK[:, 0] == e).nonzero().flatten()
        strongest = picks[probs_TE[picks, e].argsort(descending=True)][:int(c_E[e])]
        assert set(kept_tokens(plan, e)) == set(strongest.tolist())


def test_nearest_score_rule():
    """NR-s goes up iff the P mass the pads add <= the gate mass the drops remove (checked by hand)."""
    gen = torch.Generator().manual_seed(7)
    decided_differently_from_nearest = 0
    for trial in range(20):
        logits_TE = torch.randn(96, 6, generator=gen) * (1 + trial % 3)
        K, M = 2, 16
        probs_TE, topk, (plan, f_E, c_E) = route(logits_TE, K, M, "nearest_score")
        tc_gate = {(t, e): g for t, row in enumerate(topk.expert_idx_TK.tolist())
                   for e, g in zip(row, topk.gates_TK[t].tolist())}
        c_nearest = route(logits_TE, K, M, "nearest")[2].rounded_E
        for e in range(6):
            f = int(f_E[e])
            if f % M == 0:
                assert c_E[e] == f
                continue
            ranking = brute_force_ranking(probs_TE, tc_gate, e)
            down, up = f // M * M, min(math.ceil(f / M) * M, 96)
            dropped = sum(tc_gate[(t, e)] for t in ranking[down:f])
            added = sum(probs_TE[t, e].item() for t in ranking[f:up])
            assert int(c_E[e]) == (up if added <= dropped + 1e-6 else down), (trial, e, added, dropped)
            decided_differently_from_nearest += int(c_E[e] != c_nearest[e])
    assert decided_differently_from_nearest > 0  # the rule is not NR-f in disguise


def test_stochastic_rounds_up_with_probability_remainder_over_tile():
    M, T = 128, 10_000
    f_E = torch.tensor([130, 192, 250, 256, 0, 1000])
    p_up = (f_E % M).double() / M
    torch.manual_seed(0)
    n = 4000
    ups = sum((round_counts(f_E, M, "stochastic", T) > f_E // M * M).double() for _ in range(n)) / n
    assert torch.all((ups - p_up).abs() <= 4 * (p_up * (1 - p_up) / n).sqrt() + 1e-12), (ups, p_up)


def test_stochastic_is_reproduced_from_rng_state():
    logits_TE, K, M = _logits("random_large")
    state = torch.get_rng_state()
    first = route(logits_TE, K, M, "stochastic")[2].plan
    torch.set_rng_state(state)
    again = route(logits_TE, K, M, "stochastic")[2].plan
    assert torch.equal(first.token_idx_R, again.token_idx_R) and torch.equal(first.expert_idx_R, again.expert_idx_R)
    draws = [route(logits_TE, K, M, "stochastic")[2].rounded_E for _ in range(5)]
    assert any(not torch.equal(draws[0], d) for d in draws[1:])  # it is random without the reset


def test_balance_keeps_cumulative_error_within_half_a_tile():
    """Over many steps (T a multiple of M), sum(f - c) stays in [-M/2, M/2] per expert; nearest drifts."""
    M, T, E, K = 32, 256, 8, 2
    router = Router(16, E, K, RoutingConfig(method="token_rounding", rounding_mode="balance", tile_size=M)).train()
    gen = torch.Generator().manual_seed(0)
    total_f, total_c = torch.zeros(E, dtype=torch.int64), torch.zeros(E, dtype=torch.int64)
    for step in range(300):
        skew = torch.linspace(0, 2, E) * (step % 7) / 7  # varying imbalance
        out = router.route(torch.randn(T, E, generator=gen) + skew)
        total_f += out.topk_counts_E
        total_c += out.counts_E.long()
        assert torch.equal(router.balance_pending_E, total_f - total_c)
        assert (router.balance_pending_E.abs() <= M // 2).all(), (step, router.balance_pending_E)
    # the same per-step counts under nearest: a constant remainder below M/2 always rounds down
    f_E = torch.full((E,), M + 10)
    residual_E = torch.zeros(E, dtype=torch.int64)
    drift_nearest = torch.zeros(E, dtype=torch.int64)
    for _ in range(50):
        c_bal = round_counts(f_E, M, "balance", T, residual_E=residual_E)
        residual_E += f_E - c_bal
        drift_nearest += f_E - round_counts(f_E, M, "nearest", T)
        assert (residual_E.abs() <= M // 2).all()
    assert (drift_nearest == 50 * 10).all()


def test_fewer_tokens_than_tile_caps_at_t():
    logits_TE, K, M = _logits("fewer_tokens_than_tile")
    T = logits_TE.shape[0]
    _, _, (plan, f_E, c_E) = route(logits_TE, K, M, "up")
    assert ((c_E == T) | (c_E == 0)).all() and torch.equal(c_E == 0, f_E == 0)
    _, _, (plan, f_E, c_E) = route(logits_TE, K, M, "down")
    assert plan.live_rows() == 0 and plan.num_rows == T * K  # down keeps at most the top-K rows


def test_router_eval_mode_is_plain_topk():
    torch.manual_seed(0)
    x = torch.randn(300, 16)
    topk = Router(16, 8, 2, RoutingConfig(method="topk"))
    for mode in MODES:
        tr = Router(16, 8, 2, RoutingConfig(method="token_rounding", rounding_mode=mode, tile_size=32))
        tr.load_state_dict(topk.state_dict())
        train_plan = tr.train()(x).plan
        buffers = {k: v.clone() for k, v in tr.named_buffers()}
        eval_plan = tr.eval()(x).plan
        assert all(torch.equal(v, buffers[k]) for k, v in tr.named_buffers())  # eval leaves balance state alone
        ref = topk(x).plan
        for a, b in zip(eval_plan.tensors(), ref.tensors()):
            assert torch.equal(a, b)
        assert not all(c % 32 == 0 for c in ref.counts_E().tolist())  # so training mode did round
        assert all(c % 32 == 0 for c in train_plan.counts_E().tolist())
