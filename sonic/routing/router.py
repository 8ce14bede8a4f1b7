"""Router: x -> logits -> RoutingPlan, plus load-balancing losses and per-expert load.

Legend: T tokens, D hidden, E experts, K top-k.

The router GEMM runs in the compute dtype (bf16 under autocast) on the same X the experts read,
so it keeps no fp32 copy of X for backward; the selection, the softmax statistics and the losses
run in fp32 (fp64 for fp64 inputs). Two choices, each a registry (one config field, no `if` here):
  routing.backend  how top-K and the plan are computed (sonic/routing/backends.py): torch, or the
                   fused triton kernels
  routing.method   what is routed (ROUTING_METHODS, same file):
    topk            token choice (sonic/routing/token_choice.py)
    token_rounding  token choice with tile-rounded expert counts in training mode; plain
                    top-K in eval mode (sonic/routing/token_rounding.py)
    expert_choice   each expert takes its top-capacity tokens (sonic/routing/expert_choice.py)
With routing.aux_loss_scope=global (the default) the load-balancing loss counts the picks of the
whole data-parallel batch, over `stats_group` (set by the MoE block's `set_process_groups`), as
Megatron's global-batch aux loss does: one rank's few thousand tokens are a noisy load estimate.

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
from torch import Tensor, nn

from sonic import compat
from sonic.routing.backends import ROUTING_METHODS, routing_backend
from sonic.routing.balance import OFFSETS
from sonic.routing.config import RoutingConfig
from sonic.routing.losses import sequence_aux_loss, switch_aux_loss, z_loss
from sonic.routing.token_rounding import group_sum
from sonic.routing.scores import build_logit_norm, build_scores

@dataclass
class RouterOutput:
    plan: RoutingPlan
    loss: Tensor  # weighted aux, z and sequence-wise aux losses, differentiable; add it to the training loss
    aux_loss: Tensor  # unweighted, detached, for logging
    z_loss: Tensor  # unweighted, detached, for logging
    seq_aux_loss: Tensor  # unweighted, detached, for logging (0 unless routing.seq_aux_loss_coef > 0)
    counts_E: Tensor  # routed rows per expert (for load statistics and the expert bias)
    topk_counts_E: Tensor | None = None  # token-choice top-K picks per expert (before any rounding)


compat.register_pytree_dataclass(RouterOutput)  # so FSDP, compile and autograd see the tensors inside

# routing.bias_update_rule: the expert bias's step (before the rate) from each expert's relative gap to the mean load
BIAS_STEPS = {"sign": torch.sign, "proportional": lambda rel_gap_E: rel_gap_E}


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
        self.method = ROUTING_METHODS.load(cfg.method)
        self._backends: dict[torch.device, object] = {}  # resolved once per device, not per call
        self.stats_group = None  # process group whose picks the aux loss counts (None: this process)
        self.ep_group = None  # expert-parallel group: token rounding rounds its summed counts
        self.scores = build_scores(cfg.input_centring)  # x -> logits (sonic/routing/scores.py)
        self.logit_norm = build_logit_norm(cfg.logit_norm)  # logits -> logits (the same file)
        self._offset = OFFSETS[cfg.balance]  # (logits, expert bias) -> the selection's bias (sonic/routing/balance.py)

    def backend(self, device: torch.device):
        """The routing backend module on `device`. Resolved outside torch.compile where possible (the
        MoE block's `resolve_backends`): resolving imports, which a compiled graph would break at."""
        if device not in self._backends:
            self._backends[device] = routing_backend(self.cfg.backend, device)
        return self._backends[device]

    def forward(self, x_TD: Tensor, seq_len: int | None = None) -> RouterOutput:
        """x_TD in the compute dtype (the MoE block casts it once for the router and the experts):
        sequences of seq_len tokens one after another (None: one sequence)."""
        return self.route(self.logits(x_TD, seq_len), seq_len)

    def logits(self, x_TD: Tensor, seq_len: int | None = None) -> Tensor:
        """The logits the selection, the gates and the losses read: routing.input_centring, then routing.logit_norm."""
        ops = self.backend(x_TD.device)
        with torch.autocast(x_TD.device.type, enabled=False):
            return self.logit_norm(self.scores(x_TD, self.weight_ED.to(x_TD.dtype), seq_len, ops), seq_len, ops)

    def selection_bias(self, logits_TE: Tensor) -> Tensor:
        """What the top-K selection adds to logits_TE: the expert bias, plus routing.balance's offset."""
        return self._offset(logits_TE, self.expert_bias_E, self.cfg.balance_iters, self.cfg.balance_temperature)

    def route(self, logits_TE: Tensor, seq_len: int | None = None) -> RouterOutput:
        """Everything after the linear layer: selection, gates, plan, losses (in fp32 from any logits dtype).
        seq_len: as for forward (the sequence-wise balance loss reads it)."""
        cfg = self.cfg
        assert logits_TE.shape[1] == self.num_experts, logits_TE.shape
        backend = self.backend(logits_TE.device)
        topk, plan, topk_counts_E = self.method(self, logits_TE, backend)
        global_picks = cfg.aux_loss_scope == "global" and self.stats_group is not None
        picks_E = group_sum(topk_counts_E, self.stats_group) if global_picks else topk_counts_E
        aux = switch_aux_loss(topk.probsum_E / max(logits_TE.shape[0], 1), picks_E)
        z = z_loss(topk.lse_T)
        loss = cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
        seq_aux = torch.zeros_like(aux)
        if cfg.seq_aux_loss_coef > 0:  # a config constant: one extra pass over T x E only when asked for
            seq_aux = sequence_aux_loss(logits_TE, topk.lse_T, topk.expert_idx_TK, seq_len or logits_TE.shape[0])
            loss = loss + cfg.seq_aux_loss_coef * seq_aux
        return RouterOutput(plan, loss, aux.detach(), z.detach(), seq_aux.detach(), plan.counts_E(), topk_counts_E)

    @torch.no_grad()
    def update_expert_bias(self, counts_E: Tensor) -> None:
        """bias_e += rate * sign(mean count - count_e) (routing.bias_update_rule=sign), or rate * (mean count -
        count_e) / mean count (proportional): under-loaded experts become likelier picks.

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
        mean = counts_E.mean()
        rel_gap_E = (mean - counts_E) / mean.clamp_min(1)
        step_E = BIAS_STEPS[self.cfg.bias_update_rule](rel_gap_E) * self.cfg.bias_update_rate
        self.expert_bias_E.add_(step_E.to(self.expert_bias_E.dtype))
