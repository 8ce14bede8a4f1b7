"""The router's two registries: routing.backend (how top-K and the plan are computed) and
routing.method (what is routed).

Routing backends:

| name   | select_topk + plan_from_topk                                              |
|--------|---------------------------------------------------------------------------|
| torch  | sonic/routing/token_choice.py, sonic/routing/plan.py: the semantics       |
| triton | sonic/kernels/triton/routing.py: one fused kernel for the selection, its  |
|        | gates and loss statistics (and one for its backward), a counting sort for |
|        | the plan; token rounding's selection and plan in the same op (its keys    |
|        | from the select kernel, then four kernels); no sort, no histogram over    |
|        | T x E, no host sync                                                       |
| auto   | triton where it can run (a CUDA GPU with Triton), else torch              |

A backend module exposes `select_topk(logits_TE, bias_E, k, order, renormalize) -> TopK`,
`route_topk(...same...) -> (TopK, RoutingPlan)` (the selection and the plan of its picks, which the
fused backend builds in one op), `route_token_rounding(logits_TE, bias_E, k, order, renormalize, tile,
mode, residual_E) -> (TopK, RoutingPlan, f_E, c_E)` (token rounding's picks and rounded plan,
sonic/routing/token_rounding.py), `prefix_centred_logits` and `prefix_centred_logits_backward`
(routing.input_centring=prefix), `prefix_standardise` and `prefix_standardise_backward` (routing.logit_norm=prefix;
both pairs in sonic/routing/scores.py) and `unavailable_reason(device) -> str | None`, with identical results (ties
included; the centring's and the logit norm's sums, and token rounding's softmax, to fp32 rounding). A backend whose
ops launch Triton kernels through sonic.kernels.triton.launch sets `TRACED_OPS = True`: under torch.compile its ops
are traced (sonic/ops.py).
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch

from sonic.registry import Entry, Registry

ROUTING_BACKENDS = Registry("routing.backend", [
    Entry("torch", "sonic.routing.token_choice"),
    Entry("triton", "sonic.kernels.triton.routing", package="triton", extra="triton (the 'gpu' extra)"),
])
AUTO_ORDER = ("triton", "torch")

# method(router, logits_TE, backend) -> (TopK, plan, the token-choice top-K picks per expert)
ROUTING_METHODS = Registry("routing.method", [
    Entry("topk", "sonic.routing.token_choice:topk_method"),  # token choice
    Entry("token_rounding", "sonic.routing.token_rounding:token_rounding_method"),  # TR in training, top-K in eval
    Entry("expert_choice", "sonic.routing.expert_choice:expert_choice_method"),  # each expert its top-C tokens
])


def _why_unavailable(name: str, device: torch.device) -> str | None:
    return ROUTING_BACKENDS.missing(name) or ROUTING_BACKENDS.load(name).unavailable_reason(device)


@functools.lru_cache(maxsize=None)
def resolve_routing_backend(name: str, device: torch.device) -> str:
    """A requested routing backend (or auto) -> one that runs on `device`; a ValueError says why not."""
    if name == "auto":
        return next(c for c in AUTO_ORDER if _why_unavailable(c, device) is None)
    ROUTING_BACKENDS.check(name, ("auto",))
    reason = _why_unavailable(name, device)
    if reason is not None:
        raise ValueError(f"routing.backend={name!r} cannot run on {device}: {reason}. Use routing.backend=auto")
    return name


def routing_backend(name: str, device: torch.device) -> ModuleType:
    return ROUTING_BACKENDS.load(resolve_routing_backend(name, torch.device(device)))
