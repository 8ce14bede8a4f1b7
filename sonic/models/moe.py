"""MoE block: router -> RoutingPlan -> dispatch -> experts kernel (one backend switch) [+ shared expert].

Dispatch is local unless sonic/parallel installs expert parallelism (sonic/models/dispatch.py).

Expert weights are stacked tensors so FSDP shards each as one parameter:
  w1_EFD (E, 2N, D): gate/up rows interleaved (see sonic/kernels/swiglu.py)
  w2_EDN (E, D, N)
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from sonic.kernels import ExpertsFn, get_experts_fn
from sonic.models.config import MoEConfig
from sonic.models.dispatch import LocalDispatch
from sonic.models.layers import SwiGLUMLP, compute_dtype
from sonic.routing import Router, RouterOutput


class MoE(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        E, N = cfg.num_experts, cfg.expert_dim
        self.kernel_backend = cfg.kernel_backend
        self.router = Router(dim, E, cfg.top_k, cfg.routing)
        self.w1_EFD = nn.Parameter(torch.empty(E, 2 * N, dim))
        self.w2_EDN = nn.Parameter(torch.empty(E, dim, N))
        self.b1_EF = nn.Parameter(torch.zeros(E, 2 * N)) if cfg.expert_bias else None
        self.b2_ED = nn.Parameter(torch.zeros(E, dim)) if cfg.expert_bias else None
        self.shared_expert = SwiGLUMLP(dim, cfg.shared_expert_dim) if cfg.shared_expert_dim else None
        self._experts_fns: dict[torch.device, ExpertsFn] = {}  # resolved once per device, not per call
        self.dispatch = LocalDispatch()  # AllToAllDispatch under expert parallelism (sonic/parallel)

    def experts_fn(self, device: torch.device) -> ExpertsFn:
        if device not in self._experts_fns:
            self._experts_fns[device] = get_experts_fn(self.kernel_backend, device, bias=self.b1_EF is not None)
        return self._experts_fns[device]

    def forward(self, x_BSD: Tensor) -> tuple[Tensor, RouterOutput]:
        # Under autocast the kernels run in the autocast dtype; a custom autograd Function is not
        # autocast by itself, so cast here, once: router, experts and shared expert then read (and
        # save for backward) the same tensor.
        dt = compute_dtype(x_BSD)
        cast = lambda t: None if t is None else t.to(dt)  # noqa: E731
        x_TD = cast(x_BSD.reshape(-1, x_BSD.shape[-1]))
        routed = self.router(x_TD, x_BSD.shape[1])
        out_TD = self.dispatch(self.experts_fn(x_TD.device), x_TD, cast(self.w1_EFD), cast(self.w2_EDN), routed.plan,
                               cast(self.b1_EF), cast(self.b2_ED))
        if self.shared_expert is not None:
            out_TD = out_TD + self.shared_expert(x_TD)
        return out_TD.view(x_BSD.shape), routed
