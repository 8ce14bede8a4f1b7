"""Router: logits -> RoutingPlan plus load-balancing losses and per-expert load.

Legend: T tokens, D hidden, E experts, K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sonic.routing.config import RoutingConfig
from sonic.routing.plan import RoutingPlan, plan_from_topk


@dataclass
class RouterOutput:
    plan: RoutingPlan
    loss: Tensor  # weighted aux + z losses, differentiable; add it to the training loss
    aux_loss: Tensor  # unweighted, detached, for logging
    z_loss: Tensor  # unweighted, detached, for logging
    counts_E: Tensor  # routed rows per expert (for load statistics and the expert bias)


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, cfg: RoutingConfig):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe.top_k={top_k} must be between 1 and moe.num_experts={num_experts}")
        self.num_experts, self.top_k, self.cfg = num_experts, top_k, cfg
        self.weight_ED = nn.Parameter(torch.empty(num_experts, dim))
        nn.init.normal_(self.weight_ED, std=dim ** -0.5)

    def forward(self, x_TD: Tensor) -> RouterOutput:
        logits_TE = F.linear(x_TD.float(), self.weight_ED.float())  # router in fp32
        E, K = self.num_experts, self.top_k
        top_logits_TK, expert_idx_TK = logits_TE.topk(K, dim=-1)
        scores_TK = top_logits_TK.softmax(-1)
        plan = plan_from_topk(expert_idx_TK, scores_TK, E)
        probs_TE = logits_TE.softmax(-1)
        counts_E = plan.counts_E()
        frac_E = counts_E.float() / max(plan.num_rows, 1)
        aux = E * (frac_E * probs_TE.mean(0)).sum()
        z = torch.logsumexp(logits_TE, -1).square().mean()
        loss = self.cfg.aux_loss_coef * aux + self.cfg.z_loss_coef * z
        return RouterOutput(plan, loss, aux.detach(), z.detach(), counts_E)
