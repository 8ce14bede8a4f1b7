"""Token dispatch: what runs between the RoutingPlan and the expert kernels.

Legend: T tokens on this rank, D hidden, E experts, P ranks of the ep group, L = E / P experts
per rank, R this rank's routed rows (its plan), S token copies it sends (one per token and
destination rank, not one per row), U tokens it receives, Q routed rows it receives.

  LocalDispatch     every expert lives here: `experts(x_TD, w1, w2, plan)`, nothing else
  AllToAllDispatch  expert parallelism: rank q of the ep group holds experts [q*L, (q+1)*L)

AllToAllDispatch, one forward:
  1. each token goes once to each rank that holds any of its experts (S <= T*min(K, P) copies,
     fewer than the R = T*K rows a per-row dispatch sends), with its rows' (slot, local expert)
     and gates; split sizes come from the plan's expert offsets (one host sync for all of them)
  2. NCCL all-to-all (`all_to_all_single`) of the token copies, the row metadata and the gates
  3. the receiving rank builds a RoutingPlan over its U tokens and L experts and runs the usual
     kernels on it: the gather stays fused into the GEMM loads, a token's local experts are
     summed in the kernel, and dS = <dA', A> is still computed there (the gates travel, Y does not)
  4. the partial sums go back (the reverse all-to-all) and each token sums its <= P of them, in fp32 (fp64 for fp64)

What backward keeps, per MoE layer: the kernel's X (the U received tokens, U*D), H and local plan,
as without EP but over U tokens; the send index (S) and split sizes. The all-to-alls and the
gathers keep no activations. Backward runs the same exchanges in reverse.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from sonic import compat
from sonic.kernels import ExpertsFn, reference
from sonic.routing.plan import RoutingPlan, build_plan


class LocalDispatch:
    def __call__(self, experts_fn: ExpertsFn, x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
                 b1_EF: Tensor | None, b2_ED: Tensor | None) -> Tensor:
        return experts_fn(x_TD, w1_EFD, w2_EDN, plan, b1_EF, b2_ED)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


def _local(t: Tensor | None, ranks: int) -> Tensor | None:
    """This rank's experts of a weight sharded over ep (FSDP hands it over as a DTensor).

    Each rank's loss is the mean over its own tokens and data parallelism averages gradients
    over ranks. A local expert's gradient sums the tokens of all `ranks` ranks of the ep group,
    so it takes 1/ranks of it here, and FSDP's average over the ranks holding the same experts
    (efsdp, and dp_replicate) completes the mean over the world.
    """
    if t is None:
        return None
    return _ScaleGrad.apply(t.to_local() if isinstance(t, DTensor) else t, 1.0 / ranks)


class AllToAllDispatch:
    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group = group
        self.ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        assert num_experts % self.ranks == 0, (num_experts, self.ranks)
        self.local_experts = num_experts // self.ranks

    # Eager under a compiled block: dynamo would break its graph at each host sync and collective
    # here and recompile once on the changing split sizes, for a few small index ops.
    @torch.compiler.disable
    def __call__(self, experts_fn: ExpertsFn, x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
                 b1_EF: Tensor | None, b2_ED: Tensor | None) -> Tensor:
        P, L, dev = self.ranks, self.local_experts, x_TD.device
        T, D = x_TD.shape
        w1_LFD, w2_LDN, b1_LF, b2_LD = (_local(t, P) for t in (w1_EFD, w2_EDN, b1_EF, b2_ED))
        assert w1_LFD.shape[0] == L, (w1_LFD.shape, L)

        # 1. one copy per (destination rank, token), token-ascending within a destination
        token_R, expert_R = plan.token_idx_R.long(), plan.expert_idx_R.long()
        dest_R = expert_R // L
        sent_PT = torch.zeros(P, T, dtype=torch.bool, device=dev)
        sent_PT[dest_R, token_R] = True
        slot_PT = sent_PT.cumsum(1) - 1  # a token's position in its destination's chunk
        rows_P = plan.expert_offsets_E1[L::L] - plan.expert_offsets_E1[:-1:L]  # rows are sorted by expert
        send_P2 = torch.stack([sent_PT.sum(1), rows_P.long()], 1)
        recv_P2 = torch.empty_like(send_P2)
        dist.all_to_all_single(recv_P2, send_P2, group=self.group)
        counts = torch.cat([send_P2, recv_P2]).tolist()  # the host sync: every split size at once
        send_tokens, send_rows = [c[0] for c in counts[:P]], [c[1] for c in counts[:P]]
        recv_tokens, recv_rows = [c[0] for c in counts[P:]], [c[1] for c in counts[P:]]
        token_S = sent_PT.nonzero()[:, 1]

        # 2. exchange tokens, gates and the rows' (slot, local expert)
        x_UD = compat.all_to_all_single_autograd(x_TD.index_select(0, token_S), recv_tokens, send_tokens, self.group)
        scores_Q = compat.all_to_all_single_autograd(plan.scores_R, recv_rows, send_rows, self.group)
        meta_R2 = torch.stack([slot_PT[dest_R, token_R], expert_R - dest_R * L], 1).to(torch.int32)
        meta_Q2 = meta_R2.new_empty(sum(recv_rows), 2)
        dist.all_to_all_single(meta_Q2, meta_R2, recv_rows, send_rows, group=self.group)

        # 3. the local experts over the received tokens (token numbers: source-major, then slot)
        U = sum(recv_tokens)
        first_P = torch.tensor([0] + recv_tokens[:-1], device=dev).cumsum(0)
        source_Q = torch.repeat_interleave(torch.arange(P, device=dev), torch.tensor(recv_rows, device=dev),
                                           output_size=meta_Q2.shape[0])
        local_plan = build_plan(first_P[source_Q] + meta_Q2[:, 0], meta_Q2[:, 1], scores_Q, U, L)
        run = experts_fn if U else reference.experts  # the GPU kernels want at least one row
        out_UD = run(x_UD, w1_LFD, w2_LDN, local_plan, b1_LF, b2_LD)

        # 4. back to the source ranks; each token sums its partial outputs
        back_SD = compat.all_to_all_single_autograd(out_UD, send_tokens, recv_tokens, self.group)
        acc = torch.promote_types(x_TD.dtype, torch.float32)
        # index_put, not index_add: index_add's backward keeps its source (S x D) alive
        out_TD = torch.zeros(T, D, device=dev, dtype=acc).index_put((token_S,), back_SD.to(acc), accumulate=True)
        return out_TD.to(x_TD.dtype)
