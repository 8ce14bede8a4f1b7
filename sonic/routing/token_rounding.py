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
ranking keys and gates use the unbiased probabilities. Nothing waits for the device: the plan's rows are
padded to a bound (`max_rows`; sonic/routing/plan.py says how every kernel skips the padding).

Under expert parallelism (`group`, the ep process group) an expert's GEMM runs over the rows
that every rank of the group sends it, so the counts are rounded as one batch: f_e is summed
over the group (one all-reduce), c_e is decided from it identically on every rank, and the
ranks then agree on which c_e rows to keep exactly as one process holding the group's whole
batch would (tokens numbered rank-major). Each rank's candidates for e are already ranked; only
a window of 2M of them around its own f_e can be on the boundary (|c_e - f_e| < M), so the ranks
all-gather those windows' (key, P, token) triples, E * 2M per rank, and merge them. Stochastic
rounding sums the ranks' uniform draws mod 1, which is uniform and the same on every rank.
nearest_score would need the group's ranked gate sums and is not supported there. This path's plan has
no padding (the all-to-all dispatch reads every row's expert), so it waits once for its row count.

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

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from sonic import compat
from sonic.routing.plan import RoutingPlan, TopK, build_plan, plan_from_pairs
from sonic.routing.token_choice import count_per_expert, select, topk_method


class RoundedPlan(NamedTuple):
    plan: RoutingPlan
    topk_counts_E: Tensor  # f_e (int64), over the ep group when there is one
    rounded_E: Tensor  # c_e (int64) = plan.counts_E(), summed over the ep group when there is one


def tile_bounds(counts_E: Tensor, tile: int, num_tokens: int) -> tuple[Tensor, Tensor]:
    """(down_e, up_e): the tile multiples around each count, up capped at T."""
    down_E = counts_E // tile * tile
    up_E = torch.clamp((counts_E + tile - 1) // tile * tile, max=num_tokens)
    return down_E, up_E


def round_counts(counts_E: Tensor, tile: int, mode: str, num_tokens: int, *,
                 ranked_sums: tuple[Tensor, Tensor] | None = None, residual_E: Tensor | None = None,
                 uniform_E: Tensor | None = None) -> Tensor:
    """c_e per the module docstring. nearest_score needs `ranked_sums`, (the summed P of the up_e - f_e EC
    candidates rounding up would add, the summed gates of the f_e - down_e TC picks rounding down would
    drop); balance the residual; stochastic draws its own uniforms unless given `uniform_E`."""
    down_E, up_E = tile_bounds(counts_E, tile, num_tokens)
    rem_E = counts_E - down_E
    if mode == "nearest":
        go_up_E = 2 * rem_E >= tile
    elif mode == "stochastic":
        if uniform_E is None:
            uniform_E = torch.rand(counts_E.shape, device=counts_E.device)
        go_up_E = uniform_E * tile < rem_E
    elif mode == "nearest_score":
        assert ranked_sums is not None
        added_E, dropped_E = ranked_sums
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


class _RankedPicks(NamedTuple):
    """The TC picks as rows (token-major, as in expert_idx_TK.view(-1)) and their rank in their expert's
    ranking (gate desc, P desc, token asc); `sorted_gate_R`/`start_E` list the gates in rank order."""
    token_R: Tensor
    expert_R: Tensor
    rank_R: Tensor
    sorted_gate_R: Tensor
    start_E: Tensor


def _rank_picks(probs_TE: Tensor, expert_idx_TK: Tensor, gates_TK: Tensor, counts_E: Tensor) -> _RankedPicks:
    """Three stable sorts of the T*K picks (not of T x E): P desc, then gate desc, then expert asc, starting
    from token order, leave each expert's picks in ranking order."""
    T, K = expert_idx_TK.shape
    dev = probs_TE.device
    token_R = torch.arange(T, device=dev).repeat_interleave(K)
    expert_R = expert_idx_TK.reshape(-1)
    gate_R = gates_TK.reshape(-1)
    order_R = probs_TE[token_R, expert_R].argsort(descending=True, stable=True)
    order_R = order_R.gather(0, gate_R.gather(0, order_R).argsort(descending=True, stable=True))
    order_R = order_R.gather(0, expert_R.gather(0, order_R).argsort(stable=True))
    start_E = counts_E.cumsum(0) - counts_E
    rank_R = torch.empty_like(order_R).scatter_(
        0, order_R, torch.arange(order_R.numel(), device=dev) - start_E.gather(0, expert_R.gather(0, order_R)))
    return _RankedPicks(token_R, expert_R, rank_R, gate_R.gather(0, order_R), start_E)


def _top_candidates(probs_ec_ET: Tensor, take_E: Tensor, top_EM: Tensor) -> Tensor:
    """E x T mask of each expert's best take_e EC candidates by (P desc, token asc); `top_EM` holds the
    candidates' M largest P per expert (descending), take_e < M. A threshold, not a sort: every candidate
    above the take_e-th value, then the lowest tokens among those equal to it (tokens innermost: a CUDA
    scan along an outer dim is ~30x slower)."""
    threshold_E1 = top_EM.gather(1, (take_E - 1).clamp(0, top_EM.shape[1] - 1)[:, None])
    above_ET = probs_ec_ET > threshold_E1
    tied_ET = probs_ec_ET == threshold_E1
    room_E1 = (take_E - above_ET.sum(1))[:, None]
    return (above_ET | (tied_ET & (tied_ET.cumsum(1) <= room_E1))) & (take_E > 0)[:, None]


def _segment_sum(sorted_R: Tensor, start_E: Tensor, lo_E: Tensor, hi_E: Tensor) -> Tensor:
    """Per expert e, the sum of sorted_R[start_e + lo_e : start_e + hi_e] (in a fixed order; in fp64, as
    differences of a running sum over all T*K picks)."""
    csum_R1 = torch.nn.functional.pad(sorted_R.double().cumsum(0), (1, 0))
    return csum_R1.gather(0, start_E + hi_E) - csum_R1.gather(0, start_E + lo_E)


def token_rounding_plan(probs_TE: Tensor, expert_idx_TK: Tensor, gates_TK: Tensor, tile: int, mode: str,
                        residual_E: Tensor | None = None, group: dist.ProcessGroup | None = None) -> RoundedPlan:
    """The rounded plan from the full softmax and the TC top-K picks with their gates; with an ep
    `group`, rounded over the group's whole batch (module docstring).

    Only the boundary of each expert's ranking moves (|c_e - f_e| < M), so no T x E sort is needed: the TC
    picks are ranked by three sorts of the T*K picks, and the EC candidates enter by a threshold on their
    M largest probabilities per expert. The ep group's path merges windows of the full ranking instead.
    """
    if group is not None:
        return _token_rounding_plan_ep(probs_TE, expert_idx_TK, gates_TK, tile, mode, residual_E, group)
    T, E = probs_TE.shape
    gate_TE = probs_TE.scatter(1, expert_idx_TK, gates_TK)  # TC: top-K gate, EC: P_te (both differentiable)
    rows = max_rows(T, expert_idx_TK.shape[1], E, tile, mode)  # a bound on the kept count: nothing waits for it
    pairs_R2, counts_E, rounded_E = rounded_rows(probs_TE.detach(), expert_idx_TK, gates_TK.detach(), residual_E, tile,
                                                 mode, rows)
    return RoundedPlan(plan_from_pairs(*pairs_R2.unbind(1), gate_TE), counts_E, rounded_E)


# One opaque op under torch.compile: the compiled block keeps one graph around it (no graph break, whose
# extra graphs cost the 40-layer step more host time than the GPU time routing takes), and inductor does not
# see its scans (on torch 2.11 it failed to generate a T x E cumsum here, SplitScan, on the H200).
@torch.library.custom_op("sonic::token_rounding_rows", mutates_args=())
def rounded_rows(probs_TE: Tensor, expert_idx_TK: Tensor, gates_TK: Tensor, residual_E: Tensor | None, tile: int,
                 mode: str, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """The kept (expert, token) pairs (rows x 2) sorted by expert, then token, padded with -1; f_e; c_e."""
    return select_rows(probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows)


@rounded_rows.register_kernel("cuda")
def _(probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows):
    return replay_graphed(select_rows, probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows)


def rounded_rows_fake(probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows):
    E = probs_TE.shape[1]
    idx = lambda *n: probs_TE.new_empty(n, dtype=torch.int64)  # noqa: E731
    return idx(rows, 2), idx(E), idx(E)


rounded_rows.register_fake(rounded_rows_fake)


def replay_graphed(select, probs_TE: Tensor, expert_idx_TK: Tensor, gates_TK: Tensor, residual_E: Tensor | None,
                   tile: int, mode: str, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """select(...) (a backend's selection, select_rows' signature) through its CUDA graph for this shape class."""
    key = (select, tuple(probs_TE.shape), probs_TE.dtype, tuple(expert_idx_TK.shape), gates_TK.dtype,
           residual_E is not None, tile, mode, rows, probs_TE.device)
    slot = _graph_slot(key)
    if "graph" not in slot:
        slot["graph"] = GraphedSelection(select, probs_TE, expert_idx_TK, gates_TK, residual_E, tile, mode, rows)
    return slot["graph"](probs_TE, expert_idx_TK, gates_TK, residual_E)


@functools.lru_cache(maxsize=8)
def _graph_slot(key: tuple) -> dict:
    """The captured selection of one shape class (bounded: a few shapes per process)."""
    return {}


class GraphedSelection:
    """A selection captured once as a CUDA graph for one shape class. Its dozens of launches (the torch backend's on
    CUDA) cost the host more than the GPU time they take; a replay costs one launch.
    Everything in it is sync-free and sized by shapes alone (the rows are padded to max_rows), so it can be
    captured; stochastic rounding's draw is captured from the default generator, which advances per replay."""

    def __init__(self, select, probs_TE: Tensor, expert_idx_TK: Tensor, gates_TK: Tensor, residual_E: Tensor | None,
                 tile: int, mode: str, rows: int):
        self.inputs = [t.clone() for t in (probs_TE, expert_idx_TK, gates_TK, residual_E) if t is not None]
        self.args = (tile, mode, rows)
        side = torch.cuda.Stream(probs_TE.device)
        side.wait_stream(torch.cuda.current_stream(probs_TE.device))
        with torch.cuda.stream(side):  # a warm-up first: workspaces and compiled kernels exist before capture
            select(*self._args())
        torch.cuda.current_stream(probs_TE.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):  # data loader threads keep working
            self.outputs = select(*self._args())

    def _args(self) -> tuple:
        probs_TE, expert_idx_TK, gates_TK, *residual = self.inputs
        return (probs_TE, expert_idx_TK, gates_TK, residual[0] if residual else None, *self.args)

    def __call__(self, probs_TE, expert_idx_TK, gates_TK, residual_E) -> tuple[Tensor, Tensor, Tensor]:
        for dst, src in zip(self.inputs, (t for t in (probs_TE, expert_idx_TK, gates_TK, residual_E) if t is not None)):
            dst.copy_(src)
        self.graph.replay()
        return tuple(t.clone() for t in self.outputs)  # the graph's buffers are overwritten by the next replay


def select_rows(probs_TE: Tensor, expert_idx_TK: Tensor, gates_TK: Tensor, residual_E: Tensor | None, tile: int,
                mode: str, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """sonic::token_rounding_rows's computation (module docstring, steps 1-4), no host sync."""
    T, E = probs_TE.shape
    counts_E = count_per_expert(expert_idx_TK, E)
    picks = _rank_picks(probs_TE, expert_idx_TK, gates_TK, counts_E)
    # experts x tokens: the scans and the top-M run along the innermost dim, and the kept mask's nonzero
    # comes out sorted by expert, then token, as a plan's rows are
    probs_ec_ET = probs_TE.T.clone(memory_format=torch.contiguous_format)  # a copy, filled below
    probs_ec_ET.view(-1).index_fill_(0, expert_idx_TK.reshape(-1) * T + picks.token_R, -torch.inf)  # no TC pick
    top_EM = probs_ec_ET.topk(min(tile, T), dim=1).values
    ranked_sums = None
    if mode == "nearest_score":  # (added: the best up-f EC P's, dropped: the weakest f-down TC gates)
        down_E, up_E = tile_bounds(counts_E, tile, T)
        added_E = torch.nn.functional.pad(top_EM.double().cumsum(1), (1, 0)).gather(1, (up_E - counts_E)[:, None])[:, 0]
        ranked_sums = (added_E, _segment_sum(picks.sorted_gate_R, picks.start_E, down_E, counts_E))
    rounded_E = round_counts(counts_E, tile, mode, T, ranked_sums=ranked_sums, residual_E=residual_E)
    keep_R = picks.rank_R < rounded_E.gather(0, picks.expert_R)
    keep_ET = _top_candidates(probs_ec_ET, (rounded_E - counts_E).clamp_min(0), top_EM)
    keep_ET.view(-1).scatter_(0, picks.expert_R * T + picks.token_R, keep_R)
    # one output: CUDA's nonzero_static may return a transposed view, whose columns would alias each other
    return torch.nonzero_static(keep_ET, size=rows, fill_value=-1).contiguous(), counts_E, rounded_E


def max_rows(num_tokens: int, top_k: int, num_experts: int, tile: int, mode: str) -> int:
    """A bound on the rows token rounding keeps: each c_e is at most f_e plus what rounding up adds
    (under M/2 under nearest, under M otherwise, nothing under down) and at most T, and sum f_e = T*K."""
    slack = {"nearest": tile // 2, "down": 0}.get(mode, tile - 1)
    return min(num_tokens * top_k + num_experts * slack, num_tokens * num_experts)


@torch.compiler.disable  # collectives and the exact row count (a host sync) stay eager
def _token_rounding_plan_ep(probs_TE: Tensor, expert_idx_TK: Tensor, gates_TK: Tensor, tile: int, mode: str,
                            residual_E: Tensor | None, group: dist.ProcessGroup) -> RoundedPlan:
    """Token rounding over an ep group's summed counts: each rank's full ranking, and the windows around
    its f_e merged across the group (_keep_counts)."""
    if mode == "nearest_score":
        raise ValueError("routing.rounding_mode=nearest_score is not supported with parallel.ep > 1; "
                         "use nearest, stochastic or balance")
    T, E = probs_TE.shape
    gate_TE = probs_TE.scatter(1, expert_idx_TK, gates_TK)  # TC: top-K gate, EC: P_te
    is_topk_TE = torch.zeros_like(probs_TE, dtype=torch.bool).scatter_(1, expert_idx_TK, True)
    counts_E = is_topk_TE.sum(0)
    with torch.no_grad():
        order_TE = rank_candidates(gate_TE.detach(), is_topk_TE, probs_TE.detach())
        ranks = dist.get_world_size(group)
        summed = group_sum(torch.cat([counts_E, counts_E.new_tensor([T])]), group)
        topk_counts_E = summed[:E]
        assert summed[E] == T * ranks, "token rounding under EP numbers tokens rank-major: equal T per rank"
        uniform_E = None
        if mode == "stochastic":  # the same draw on every rank of the group
            uniform_E = group_sum(torch.rand(E, device=probs_TE.device, dtype=torch.float64), group).frac()
        rounded_E = round_counts(topk_counts_E, tile, mode, T * ranks, residual_E=residual_E, uniform_E=uniform_E)
        key_TE = torch.where(is_topk_TE, gate_TE.detach(), probs_TE.detach() - 1)
        keep_E = _keep_counts(order_TE, key_TE, probs_TE.detach(), counts_E, rounded_E, tile, group)
    keep_TE = torch.arange(T, device=probs_TE.device)[:, None] < keep_E[None, :]
    rank_idx, expert_idx = keep_TE.nonzero(as_tuple=True)  # the one host sync: the kept row count
    token_idx = order_TE[rank_idx, expert_idx]
    plan = build_plan(token_idx, expert_idx, gate_TE[token_idx, expert_idx], T, E)
    return RoundedPlan(plan, topk_counts_E, rounded_E)


def group_sum(t: Tensor, group) -> Tensor:
    """t summed over a process group; a functional collective: traceable by torch.compile, no host sync."""
    return compat.functional_all_reduce(t, "sum", group)


def _keep_counts(order_TE: Tensor, key_TE: Tensor, probs_TE: Tensor, counts_E: Tensor, rounded_E: Tensor,
                 tile: int, group: dist.ProcessGroup) -> Tensor:
    """How many of its ranked candidates per expert this rank keeps, so that the group keeps the
    top rounded_E of its whole batch by (key desc, P desc, token asc).

    A rank's candidates ranked above f_e - M are kept whatever the other ranks hold (fewer than
    M rows are dropped from the group's f_e), and those at f_e + M or below are not (fewer than
    M are added), so only the window [f_e - M, f_e + M) of each rank needs merging.
    """
    T, E = key_TE.shape
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    start_E = (counts_E - tile).clamp_min(0)
    pos_WE = start_E[None, :] + torch.arange(2 * tile, device=key_TE.device)[:, None]
    valid_WE = pos_WE < T
    tok_WE = order_TE.gather(0, pos_WE.clamp(max=T - 1))
    neg_inf = torch.tensor(-torch.inf, dtype=torch.float64, device=key_TE.device)
    window_3WE = torch.stack([torch.where(valid_WE, key_TE.gather(0, tok_WE).double(), neg_inf),
                              torch.where(valid_WE, probs_TE.gather(0, tok_WE).double(), neg_inf),
                              (tok_WE + rank * T).double(),  # the token's number in the group's batch
                              start_E.double().expand_as(pos_WE)])
    gathered = [torch.empty_like(window_3WE) for _ in range(ranks)]
    dist.all_gather(gathered, window_3WE, group=group)
    key_CE, prob_CE, tok_CE, start_CE = (torch.cat(parts) for parts in zip(*gathered))  # C = ranks * 2M
    owner_CE = torch.arange(ranks, device=key_TE.device).repeat_interleave(2 * tile)[:, None].expand_as(key_CE)
    order_CE = tok_CE.argsort(dim=0, stable=True)  # token asc, then P desc, then key desc (stable passes)
    order_CE = order_CE.gather(0, prob_CE.gather(0, order_CE).argsort(dim=0, descending=True, stable=True))
    order_CE = order_CE.gather(0, key_CE.gather(0, order_CE).argsort(dim=0, descending=True, stable=True))
    needed_E = rounded_E - start_CE[:: 2 * tile].sum(0).long()  # rows still to take from the windows
    taken_CE = torch.arange(key_CE.shape[0], device=key_TE.device)[:, None] < needed_E[None, :]
    mine_E = (taken_CE & (owner_CE.gather(0, order_CE) == rank)).sum(0)
    return start_E + mine_E


def recomputing() -> bool:
    """True inside a backward pass, i.e. when activation checkpointing re-runs this forward."""
    return compat.in_backward()


def route_token_rounding(backend, logits_TE: Tensor, bias_E: Tensor, k: int, order: str, renormalize: bool, tile: int,
                         mode: str, residual_E: Tensor | None) -> tuple[TopK, RoutingPlan, Tensor, Tensor]:
    """A routing backend's route_token_rounding from its select_topk and this module's selection: (the top-K picks,
    the rounded plan, f_e, c_e). The torch backend's, which defines it, and the fused backend's under
    nearest_score."""
    topk = backend.select_topk(logits_TE, bias_E, k, order, renormalize)
    probs_TE = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32)).softmax(-1)
    rounded = token_rounding_plan(probs_TE, topk.expert_idx_TK, topk.gates_TK, tile, mode, residual_E=residual_E)
    return topk, rounded.plan, rounded.topk_counts_E, rounded.rounded_E


def token_rounding_method(router, logits_TE: Tensor, backend) -> tuple[TopK, RoutingPlan, Tensor]:
    """routing.method=token_rounding: rounded counts in training mode, plain top-K in eval mode. Under
    rounding_mode=balance the router's residual buffers carry f - c across steps (Router docstring); asking
    whether this forward is a recompute breaks a compiled graph there (the other modes keep one graph)."""
    if not router.training:
        return topk_method(router, logits_TE, backend)
    cfg = router.cfg
    balance = cfg.rounding_mode == "balance"
    if balance and not recomputing():
        router.balance_residual_E.copy_(router.balance_pending_E)
    residual_E = router.balance_residual_E if balance else None
    if router.ep_group is None:  # the backend's one op: selection, rounding and plan
        topk, plan, topk_counts_E, rounded_E = backend.route_token_rounding(
            logits_TE, router.selection_bias(logits_TE), router.top_k, cfg.order, cfg.renormalize, cfg.tile_size,
            cfg.rounding_mode, residual_E)
        group_counts_E = topk_counts_E
    else:  # rounded over the ep group's summed counts, which this rank's f_e is not
        topk = select(router, logits_TE, backend)
        probs_TE = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32)).softmax(-1)
        plan, group_counts_E, rounded_E = token_rounding_plan(probs_TE, topk.expert_idx_TK, topk.gates_TK,
                                                              cfg.tile_size, cfg.rounding_mode, residual_E=residual_E,
                                                              group=router.ep_group)
        topk_counts_E = count_per_expert(topk.expert_idx_TK, router.num_experts)
    if balance and not recomputing():
        router.balance_pending_E.copy_(router.balance_residual_E + group_counts_E - rounded_E)
    return topk, plan, topk_counts_E
