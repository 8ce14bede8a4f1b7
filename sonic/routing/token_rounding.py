"""Token rounding (SonicMoE, Algorithm 4): top-K routing with per-expert counts on tile multiples.

Legend: T tokens, E experts, K top-k, M the tile size (`routing.tile_size`).

Why: a grouped GEMM pads every expert's rows up to a multiple of M, so the last tile of
each expert is partly wasted work. Token rounding moves each expert's count f_e to a
multiple of M by dropping its weakest top-K (TC) picks or adding its strongest
expert-choice (EC) candidates, so no tile is partial.

1. Top-K selection, f_e = TC rows of expert e.
2. Round f_e to c_e (the rule per mode below), both candidates on the tile grid:
     down_e = floor(f_e / M) * M,   up_e = min(ceil(f_e / M) * M, T)
   so c_e is a multiple of M, or T when rounding up would pass T (an expert cannot take
   a token twice). |c_e - f_e| < M, and c_e = f_e when f_e already is a multiple of M.
3. Rank every (token, expert) with key S' = S - 1, where S is the full-softmax
   probability P_te, except that TC entries take their top-K gate (>= 0), so every TC
   pick ranks above every EC candidate (< 0). Ties between keys break by P_te, then by
   token index (this matters for topk_softmax with K=1, where every TC gate is 1).
4. Expert e keeps the first c_e tokens of its ranking.

Gates: TC rows keep their top-K gate; EC rows get P_te, as the official sonic-moe
benchmark does. An aux-loss-free expert bias only moves the TC selection (step 1); the
ranking keys and gates use the unbiased probabilities. Only the final row selection synchronises with the host (the row count is
data dependent); counts and rounding decisions stay on device.

Rounding rules (r_e = f_e mod M; every rule returns down_e when r_e = 0):
  nearest        up iff 2 r_e >= M (NR-f; a tie rounds up, keeping the TC picks)
  stochastic     up with probability r_e / M (SR-f), one torch.rand(E) on f's device, so
                 a restored RNG state (activation checkpointing) reproduces the decision
  nearest_score  NR-f measured in score instead of rows (NR-s): up iff the summed P_te of
                 the (up_e - f_e) EC candidates that rounding up would add <= the summed TC
                 gates of the (f_e - down_e) TC picks that rounding down would drop, i.e.
                 the side that perturbs the top-K output less, by gate mass (tie: up)
  balance        the one of down_e, up_e that brings the running residual
                 C_e + f_e - c_e closest to 0 (tie: down). C_e, the cumulative f - c over
                 past steps, then stays within [-M/2, M/2] whenever T is a multiple of M
                 (so up_e is never capped)
  up             up_e (no TC pick is dropped)
  down           down_e (token dropping)
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from sonic.routing.plan import RoutingPlan, build_plan


class RoundedPlan(NamedTuple):
    plan: RoutingPlan
    topk_counts_E: Tensor  # f_e (int64)
    rounded_E: Tensor  # c_e (int64) = plan.counts_E()


def tile_bounds(counts_E: Tensor, tile: int, num_tokens: int) -> tuple[Tensor, Tensor]:
    """(down_e, up_e): the tile multiples around each count, up capped at T."""
    down_E = counts_E // tile * tile
    up_E = torch.clamp((counts_E + tile - 1) // tile * tile, max=num_tokens)
    return down_E, up_E


def _segment_sums(ranked_TE: Tensor, lo_E: Tensor, hi_E: Tensor) -> Tensor:
    """Per column e, the sum of ranked_TE[lo_e:hi_e, e]."""
    csum_T1E = torch.nn.functional.pad(ranked_TE.cumsum(0), (0, 0, 1, 0))
    return csum_T1E.gather(0, hi_E[None]).squeeze(0) - csum_T1E.gather(0, lo_E[None]).squeeze(0)


def round_counts(counts_E: Tensor, tile: int, mode: str, num_tokens: int, *,
                 ranked_gates_TE: Tensor | None = None, residual_E: Tensor | None = None) -> Tensor:
    """c_e per the module docstring. nearest_score needs the ranked gates, balance the residual."""
    down_E, up_E = tile_bounds(counts_E, tile, num_tokens)
    rem_E = counts_E - down_E
    if mode == "nearest":
        go_up_E = 2 * rem_E >= tile
    elif mode == "stochastic":
        go_up_E = torch.rand(counts_E.shape, device=counts_E.device) * tile < rem_E
    elif mode == "nearest_score":
        assert ranked_gates_TE is not None
        added_E = _segment_sums(ranked_gates_TE, counts_E, up_E)
        dropped_E = _segment_sums(ranked_gates_TE, down_E, counts_E)
        go_up_E = added_E <= dropped_E
    elif mode == "balance":
        assert residual_E is not None
        target_E = residual_E + counts_E
        go_up_E = (target_E - up_E).abs() < (target_E - down_E).abs()
    elif mode == "up":
        go_up_E = torch.ones_like(counts_E, dtype=torch.bool)
    else:
        assert mode == "down", mode
        go_up_E = torch.zeros_like(counts_E, dtype=torch.bool)
    return torch.where(go_up_E, up_E, down_E)


def rank_candidates(gate_TE: Tensor, is_topk_TE: Tensor, probs_TE: Tensor) -> Tensor:
    """order_TE[:, e] = tokens by descending key S' for expert e (the module docstring, step 3)."""
    key_TE = torch.where(is_topk_TE, gate_TE, probs_TE - 1)
    by_prob_TE = probs_TE.argsort(dim=0, descending=True, stable=True)
    by_key_TE = key_TE.gather(0, by_prob_TE).argsort(dim=0, descending=True, stable=True)
    return by_prob_TE.gather(0, by_key_TE)


def token_rounding_plan(probs_TE: Tensor, expert_idx_TK: Tensor, gates_TK: Tensor, tile: int, mode: str,
                        residual_E: Tensor | None = None) -> RoundedPlan:
    """The rounded plan from the full softmax and the TC top-K picks with their gates."""
    T, E = probs_TE.shape
    gate_TE = probs_TE.scatter(1, expert_idx_TK, gates_TK)  # TC: top-K gate, EC: P_te
    is_topk_TE = torch.zeros_like(probs_TE, dtype=torch.bool).scatter_(1, expert_idx_TK, True)
    counts_E = is_topk_TE.sum(0)
    with torch.no_grad():
        order_TE = rank_candidates(gate_TE.detach(), is_topk_TE, probs_TE.detach())
        ranked_gates_TE = gate_TE.detach().gather(0, order_TE) if mode == "nearest_score" else None
        rounded_E = round_counts(counts_E, tile, mode, T, ranked_gates_TE=ranked_gates_TE, residual_E=residual_E)
    keep_TE = torch.arange(T, device=probs_TE.device)[:, None] < rounded_E[None, :]
    rank_idx, expert_idx = keep_TE.nonzero(as_tuple=True)  # the one host sync: the kept row count
    token_idx = order_TE[rank_idx, expert_idx]
    plan = build_plan(token_idx, expert_idx, gate_TE[token_idx, expert_idx], T, E)
    return RoundedPlan(plan, counts_E, rounded_E)
