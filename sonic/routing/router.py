"""Router: x -> logits -> RoutingPlan, plus load-balancing losses and per-expert load.

Legend: T tokens, D hidden, E experts, K top-k.

The router GEMM runs in the compute dtype (bf16 under autocast) on the same X the experts read,
so it keeps no fp32 copy of X for backward; softmax, top-K and the losses run in fp32 (fp64 for
fp64 inputs). With routing.aux_loss_scope=global (the default) the load-balancing loss counts the
picks of the whole data-parallel batch, over `stats_group` (sonic/parallel sets it), as Megatron's
global-batch aux loss does: one rank's few thousand tokens are a noisy load estimate. Methods:
  topk            token choice (sonic/routing/token_choice.py)
  token_rounding  token choice with tile-rounded expert counts in training mode; plain
                  top-K in eval mode (sonic/routing/token_rounding.py)
  expert_choice   each expert takes its top-capacity tokens (sonic/routing/expert_choice.py)

State (persistent buffers, so a checkpoint resumes routing exactly):
  expert_bias_E          aux-loss-free bias (DeepSeek-V3): added to the logits for the top-K
                         selection only, never to the gates; see `update_expert_bias`.
  balance_residual_E     token_rounding balance mode: the cumulative f - c that the current
  balance_pending_E      micro-batch rounds against, and the one after it. The first forward
                         of a micro-batch commits pending -> residual; a forward recomputed
                         inside backward (activation checkpointing) only reads the residual,
                         so it repeats the original decision. This assumes each micro-batch's
                         backward runs before the next micro-batch's forward (no pipelining).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree
from torch import Tensor, nn

from sonic.routing.config import RoutingConfig
from sonic.routing.expert_choice import expert_capacity, expert_choice_plan
from sonic.routing.losses import switch_aux_loss, z_loss
from sonic.routing.plan import RoutingPlan, plan_from_topk
from sonic.routing.scores import build_scores
from sonic.routing.token_choice import count_per_expert, select_topk
from sonic.routing.token_rounding import group_sum, token_rounding_plan


@dataclass
class RouterOutput:
    plan: RoutingPlan
    loss: Tensor  # weighted aux + z losses, differentiable; add it to the training loss
    aux_loss: Tensor  # unweighted, detached, for logging
    z_loss: Tensor  # unweighted, detached, for logging
    counts_E: Tensor  # routed rows per expert (for load statistics and the expert bias)
    topk_counts_E: Tensor | None = None  # token-choice top-K picks per expert (before any rounding)


# A pytree, so FSDP, compile and autograd utilities see the tensors inside.
torch.utils._pytree.register_dataclass(RouterOutput)

def _recomputing() -> bool:
    """True inside a backward pass, i.e. when activation checkpointing re-runs this forward."""
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, cfg: RoutingConfig):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe.top_k={top_k} must be between 1 and moe.num_experts={num_experts}")
        self.num_experts, self.top_k, self.cfg = num_experts, top_k, cfg
        self.weight_ED = nn.Parameter(torch.empty(num_experts, dim))
        nn.init.normal_(self.weight_ED, std=dim ** -0.5)
        self.register_buffer("expert_bias_E", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("balance_residual_E", torch.zeros(num_experts, dtype=torch.int64))
        self.register_buffer("balance_pending_E", torch.zeros(num_experts, dtype=torch.int64))
        self.stats_group = None  # process group whose picks the aux loss counts (None: this process)
        self.ep_group = None  # expert-parallel group: token rounding rounds its summed counts (sonic/parallel)
        self.scores = build_scores(cfg.input_centring)  # x -> logits (sonic/routing/scores.py)

    def forward(self, x_TD: Tensor, seq_len: int | None = None) -> RouterOutput:
        """x_TD in the compute dtype (the MoE block casts it once for the router and the experts):
        sequences of seq_len tokens one after another (None: one sequence)."""
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = self.scores(x_TD, self.weight_ED.to(x_TD.dtype), seq_len)
        return self.route(logits_TE.to(torch.promote_types(x_TD.dtype, torch.float32)))

    def route(self, logits_TE: Tensor) -> RouterOutput:
        """Everything after the linear layer: selection, gates, plan, losses."""
        cfg, E, K = self.cfg, self.num_experts, self.top_k
        T = logits_TE.shape[0]
        assert logits_TE.shape[1] == E, logits_TE.shape
        probs_TE = logits_TE.softmax(-1)
        select_TE = logits_TE.detach() + self.expert_bias_E.to(logits_TE.dtype)
        topk = select_topk(logits_TE, select_TE, probs_TE, K, cfg.order, cfg.renormalize)
        topk_counts_E = count_per_expert(topk.expert_idx_TK, E)
        if cfg.method == "expert_choice":
            capacity = expert_capacity(T, E, K, cfg.capacity_factor)
            plan = expert_choice_plan(probs_TE, select_TE.softmax(-1), capacity)
        elif cfg.method == "token_rounding" and self.training:
            plan = self._token_rounding(probs_TE, topk.expert_idx_TK, topk.gates_TK)
        else:
            plan = plan_from_topk(topk.expert_idx_TK, topk.gates_TK, E)
        global_picks = cfg.aux_loss_scope == "global" and self.stats_group is not None
        picks_E = group_sum(topk_counts_E, self.stats_group) if global_picks else topk_counts_E
        aux = switch_aux_loss(probs_TE, picks_E)
        z = z_loss(logits_TE)
        loss = cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
        return RouterOutput(plan, loss, aux.detach(), z.detach(), plan.counts_E(), topk_counts_E)

    def _token_rounding(self, probs_TE: Tensor, expert_idx_TK: Tensor, gates_TK: Tensor) -> RoutingPlan:
        mode, balance = self.cfg.rounding_mode, self.cfg.rounding_mode == "balance"
        if balance and not _recomputing():
            self.balance_residual_E.copy_(self.balance_pending_E)
        rounded = token_rounding_plan(probs_TE, expert_idx_TK, gates_TK, self.cfg.tile_size, mode,
                                      residual_E=self.balance_residual_E if balance else None, group=self.ep_group)
        if balance and not _recomputing():
            self.balance_pending_E.copy_(self.balance_residual_E + rounded.topk_counts_E - rounded.rounded_E)
        return rounded.plan

    @torch.no_grad()
    def update_expert_bias(self, counts_E: Tensor) -> None:
        """bias_e += rate * sign(mean count - count_e): under-loaded experts become likelier picks.

        Call after the optimizer step with the step's routed rows per expert, summed over
        micro-batches and all-reduced over ranks, so every rank applies the same update.
        A no-op when routing.bias_update_rate is 0.
        """
        if counts_E.shape != (self.num_experts,):
            raise ValueError(f"update_expert_bias expects counts of shape ({self.num_experts},), "
                             f"got {tuple(counts_E.shape)}")
        if self.cfg.bias_update_rate == 0:
            return
        counts_E = counts_E.to(self.expert_bias_E.device, torch.float32)
        step_E = torch.sign(counts_E.mean() - counts_E) * self.cfg.bias_update_rate
        self.expert_bias_E.add_(step_E.to(self.expert_bias_E.dtype))
