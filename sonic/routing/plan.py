"""RoutingPlan: the single routing-metadata object every kernel backend consumes.

Legend: T tokens, E experts, K top-k, R routed rows (T*K under top-K; data-dependent
under expert choice; a bound under token rounding, see below).

Routed rows are sorted by expert, and by token within an expert, so that each expert's
rows form one contiguous segment (the varlen-M grouped GEMM) and its gathers walk X in
increasing address order. A token's rows, in turn, are listed by `rows_by_token_R` so
that the aggregation is a deterministic per-token gather-sum without atomics.

Padding: a plan whose row count is data dependent can be sized by a bound instead, so that building it
never waits for the device (token rounding does this). Its live rows are [0, expert_offsets_E1[E]); the
rows after them are padding: expert E (no expert), token 0, score 0, listed last in rows_by_token_R and
outside every offset range. Every backend computes the live rows only (the grouped GEMMs schedule tiles
from expert_offsets_E1, the gather-sums read token_offsets_T1), and padding gets no gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from sonic import compat


class TopK(NamedTuple):
    """Token choice before any plan: what every routing backend's select_topk returns."""
    expert_idx_TK: Tensor  # int64: each token's K distinct experts
    gates_TK: Tensor  # differentiable gate of each pick (fp32)
    probsum_E: Tensor  # differentiable: the full softmax summed over the tokens (the aux loss's P_e, times T)
    lse_T: Tensor  # differentiable: logsumexp of each token's logits (the z-loss's)


@dataclass(frozen=True)
class RoutingPlan:
    token_idx_R: Tensor  # int32: source token of each routed row
    expert_idx_R: Tensor  # int32: expert of each row (non-decreasing)
    scores_R: Tensor  # gate of each row (float32 from the router); grad flows back to it
    expert_offsets_E1: Tensor  # int32: rows of expert e are [off[e], off[e+1])
    token_offsets_T1: Tensor  # int32: token t's rows are rows_by_token_R[off[t]:off[t+1]]
    rows_by_token_R: Tensor  # int32: routed row ids grouped by token (token-ascending)

    @property
    def num_tokens(self) -> int:
        return self.token_offsets_T1.numel() - 1

    @property
    def num_experts(self) -> int:
        return self.expert_offsets_E1.numel() - 1

    @property
    def num_rows(self) -> int:
        """R: the rows' buffer size, padding included."""
        return self.token_idx_R.numel()

    def live_rows(self) -> int:
        """The routed rows that are not padding (a host sync: for tests and benchmarks)."""
        return int(self.expert_offsets_E1[-1])

    def counts_E(self) -> Tensor:
        """Routed rows per expert (int32, on device, no host sync)."""
        return self.expert_offsets_E1[1:] - self.expert_offsets_E1[:-1]

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor the plan holds: the scores and the integer metadata."""
        return (self.scores_R,) + self.metadata()

    @property
    def nbytes(self) -> int:
        """Bytes of all the plan's tensors: what a kernel caching the plan keeps for backward."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def metadata(self) -> tuple[Tensor, ...]:
        """The integer fields, for passing a plan through an autograd.Function."""
        return (self.token_idx_R, self.expert_idx_R, self.expert_offsets_E1, self.token_offsets_T1,
                self.rows_by_token_R)

    @staticmethod
    def from_metadata(scores_R: Tensor, meta: tuple[Tensor, ...]) -> "RoutingPlan":
        """Inverse of `metadata()`."""
        token_idx_R, expert_idx_R, expert_offsets_E1, token_offsets_T1, rows_by_token_R = meta
        return RoutingPlan(token_idx_R, expert_idx_R, scores_R, expert_offsets_E1, token_offsets_T1,
                           rows_by_token_R)

    def with_scores(self, scores_R: Tensor) -> "RoutingPlan":
        """Same routing, different gates (e.g. detached or re-cast)."""
        assert scores_R.shape == self.scores_R.shape
        return RoutingPlan(self.token_idx_R, self.expert_idx_R, scores_R, self.expert_offsets_E1,
                           self.token_offsets_T1, self.rows_by_token_R)


compat.register_pytree_dataclass(RoutingPlan)  # so FSDP, compile and autograd see the tensors inside

def _offsets(sorted_ids: Tensor, num_ids: int) -> Tensor:
    """Segment offsets (num_ids + 1, int32) of a non-decreasing id sequence.

    A binary search per boundary instead of `bincount`: bincount sizes its output from the
    maximum id and so synchronises with the host on CUDA; this does not, and is deterministic.
    """
    bounds = torch.arange(num_ids + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, bounds, out_int32=True)


def build_plan(token_idx: Tensor, expert_idx: Tensor, scores: Tensor, num_tokens: int,
               num_experts: int, sorted_by_expert: bool = False) -> RoutingPlan:
    """Build a plan from unordered (token, expert, score) triples, or from triples already sorted by
    (expert, token) when `sorted_by_expert` (no sort needed then).

    Each (token, expert) pair must appear at most once. A triple with expert `num_experts` is padding
    (module docstring: token 0, score 0). Runs on the triples' device with no host synchronisation;
    `scores` keeps its autograd history.
    """
    assert token_idx.shape == expert_idx.shape == scores.shape and token_idx.dim() == 1
    if sorted_by_expert:
        token_idx_R, expert_idx_R, scores_R = token_idx.to(torch.int32), expert_idx.to(torch.int32), scores
    else:
        order = torch.argsort(expert_idx.long() * num_tokens + token_idx.long())
        token_idx_R = token_idx[order].to(torch.int32)
        expert_idx_R = expert_idx[order].to(torch.int32)
        # index_select, not scores[order]: its backward is an index_add (order is a permutation, so
        # no two rows collide), where advanced indexing's backward sorts: 1.2 ms per layer at T*K=131k
        scores_R = scores.index_select(0, order)
    # padding rows take token T here, so that they come last by token and no token's range holds them
    token_key_R = torch.where(expert_idx_R < num_experts, token_idx_R, num_tokens)
    rows_by_token_R = torch.argsort(token_key_R, stable=True).to(torch.int32)
    return RoutingPlan(
        token_idx_R=token_idx_R,
        expert_idx_R=expert_idx_R,
        scores_R=scores_R,
        expert_offsets_E1=_offsets(expert_idx_R, num_experts),
        token_offsets_T1=_offsets(token_key_R[rows_by_token_R.long()], num_tokens),
        rows_by_token_R=rows_by_token_R,
    )


def plan_from_mask(keep_ET: Tensor, gate_TE: Tensor, rows: int) -> RoutingPlan:
    """Plan of the (expert, token) pairs that keep_ET marks, with their gates from gate_TE (differentiable),
    padded to `rows` rows (module docstring) with no host sync. `rows` must be at least the marked count:
    nonzero_static drops what passes it, so callers size it by a bound they can prove."""
    # E x T, row-major: the pairs come out sorted by expert, then token, as a plan's rows are
    expert_R, token_R = torch.nonzero_static(keep_ET, size=rows, fill_value=-1).unbind(1)
    return plan_from_pairs(expert_R, token_R, gate_TE)


def plan_from_pairs(expert_R: Tensor, token_R: Tensor, gate_TE: Tensor) -> RoutingPlan:
    """Plan of (expert, token) pairs sorted by expert, then token, each at most once, where -1 marks a
    padding row (module docstring); their gates come from gate_TE (differentiable). No host sync."""
    T, E = gate_TE.shape
    live = expert_R >= 0
    expert_idx = torch.where(live, expert_R, E)  # padding: expert E, token 0, score 0
    token_idx = token_R.clamp_min(0)
    gate_R = gate_TE.reshape(-1).index_select(0, token_idx * E + expert_idx.clamp(max=E - 1))
    scores = torch.where(live, gate_R, torch.zeros((), dtype=gate_R.dtype, device=gate_R.device))
    return build_plan(token_idx, expert_idx, scores, T, E, sorted_by_expert=True)


def plan_from_topk(expert_idx_TK: Tensor, scores_TK: Tensor, num_experts: int) -> RoutingPlan:
    """Plan for token choice: every token has exactly K distinct experts."""
    T, K = expert_idx_TK.shape
    token_idx = torch.arange(T, device=expert_idx_TK.device).repeat_interleave(K)
    return build_plan(token_idx, expert_idx_TK.reshape(-1), scores_TK.reshape(-1), T, num_experts)
