"""MoE block: router -> RoutingPlan -> dispatch -> experts kernel (one backend switch) [+ shared expert].

The block owns its dispatch: local, or all-to-all over an expert-parallel group once sonic/parallel
hands it its process groups through `set_process_groups` (sonic/models/dispatch.py).

Expert weights are stacked tensors so FSDP shards each as one parameter:
  w1_EFD (E, 2N, D): gate/up rows interleaved (see sonic/kernels/swiglu.py)
  w2_EDN (E, D, N)
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Shard, distribute_tensor

from sonic.kernels import ExpertsFn, get_experts_fn
from sonic.models.config import MoEConfig
from sonic.models.dispatch import AllToAllDispatch, LocalDispatch
from sonic.models.layers import SwiGLUMLP, compute_dtype
from sonic.routing import Router, RouterOutput


EXPERT_WEIGHTS = ("w1_EFD", "w2_EDN", "b1_EF", "b2_ED")  # stacked by expert: sharded by expert under EP


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
        self.dispatch = LocalDispatch()  # AllToAllDispatch under expert parallelism: set_process_groups

    def set_process_groups(self, stats_group=None, ep_mesh=None) -> None:
        """The groups this block works over: `stats_group`, whose expert picks the global aux loss counts,
        and `ep_mesh`, a 1-D mesh whose rank q keeps experts [q*E/P, (q+1)*E/P) and receives their tokens by
        all-to-all (token rounding then rounds the group's summed counts)."""
        self.router.stats_group = stats_group
        if ep_mesh is None:
            return
        group = ep_mesh.get_group()
        for name in EXPERT_WEIGHTS:
            weight = getattr(self, name)
            if weight is not None:
                setattr(self, name, nn.Parameter(distribute_tensor(weight.detach(), ep_mesh, [Shard(0)],
                                                                   src_data_rank=None)))
        self.dispatch = AllToAllDispatch(group, self.router.num_experts)
        self.router.ep_group = group

    def experts_fn(self, device: torch.device) -> ExpertsFn:
        if device not in self._experts_fns:
            self._experts_fns[device] = get_experts_fn(self.kernel_backend, device, bias=self.b1_EF is not None)
        return self._experts_fns[device]

    def resolve_backends(self, device: torch.device) -> None:
        """Pick the expert kernels and the routing backend for `device` now, before torch.compile traces a
        forward: resolving imports modules, and a compiled graph would break there (sonic/parallel calls this)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # tensors name their device with its index
            device = torch.device("cuda", torch.cuda.current_device())
        self.experts_fn(device)
        self.router.backend(device)

    def forward(self, x_BSD: Tensor) -> tuple[Tensor, RouterOutput]:
        # Under autocast the kernels run in the autocast dtype; a custom autograd Function is not
        # autocast by itself, so cast here, once: router, experts and shared expert then read (and
        # save for backward) the same tensor.
        assert x_BSD.dim() == 3, f"MoE takes (batch, seq, dim) input: the router reads sequences; got {x_BSD.shape}"
        dt = compute_dtype(x_BSD)
        cast = lambda t: None if t is None else t.to(dt)  # noqa: E731
        x_TD = cast(x_BSD.reshape(-1, x_BSD.shape[-1]))
        routed = self.router(x_TD, x_BSD.shape[1])
        out_TD = self.dispatch(self.experts_fn(x_TD.device), x_TD, cast(self.w1_EFD), cast(self.w2_EDN), routed.plan,
                               cast(self.b1_EF), cast(self.b2_ED))
        if self.shared_expert is not None:
            out_TD = out_TD + self.shared_expert(x_TD)
        return out_TD.view(x_BSD.shape), routed
