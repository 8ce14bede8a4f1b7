"""Routing configuration (a Hydra structured config, nested under the model's `moe`)."""
from __future__ import annotations

from dataclasses import dataclass

from sonic.routing.backends import ROUTING_BACKENDS, ROUTING_METHODS
from sonic.routing.balance import BALANCES
from sonic.routing.scores import CENTRINGS, LOGIT_NORMS

ORDERS = ("topk_softmax", "softmax_topk")
ROUNDING_MODES = ("nearest", "stochastic", "nearest_score", "balance", "up", "down")
AUX_SCOPES = ("global", "local")
BIAS_RULES = ("sign", "proportional")


@dataclass
class RoutingConfig:
    backend: str = "auto"  # auto (triton on a CUDA GPU, else torch) | torch | triton: sonic/routing/backends.py
    method: str = "topk"  # topk | token_rounding (training only; eval uses topk) | expert_choice
    order: str = "topk_softmax"  # topk_softmax: softmax over the K picked logits | softmax_topk
    renormalize: bool = False  # softmax_topk only: rescale the K picked probabilities to sum to 1
    # token_rounding: NR-f nearest | SR-f stochastic | NR-s nearest_score | Balance-f balance | up | down
    rounding_mode: str = "nearest"
    tile_size: int = 128  # token_rounding: M_tile, the GEMM tile the expert counts are rounded to
    capacity_factor: float = 1.0  # expert_choice: each expert takes capacity_factor * T*K/E tokens
    aux_loss_coef: float = 0.01  # Switch load-balancing loss
    aux_loss_scope: str = "global"  # global: expert fractions over all data-parallel ranks' tokens | local: this rank's
    z_loss_coef: float = 0.0  # router z-loss
    # DeepSeek-V3's sequence-wise balance loss: the Switch loss within each sequence, averaged (0: off)
    seq_aux_loss_coef: float = 0.0
    bias_update_rate: float = 0.0  # aux-loss-free expert bias (DeepSeek-V3); 0 disables it
    # sign: every expert's bias moves by the rate each step (DeepSeek-V3) | proportional: by the rate times its
    # relative gap to the mean load, (mean - count) / mean, so a hot expert is pulled back in a few steps
    bias_update_rule: str = "sign"
    # none: logits from the hidden state x (as Hugging Face OLMoE / Qwen3-MoE) | prefix: from x minus the mean of
    # the earlier positions of its sequence, at unit RMS (keeps deep routers balanced; sonic/routing/scores.py)
    input_centring: str = "none"
    # none: the logits as they are | prefix: each expert's logit standardised by its mean and spread over the earlier
    # positions of its sequence, so that no expert wins top-K by a wider logit distribution (sonic/routing/scores.py)
    logit_norm: str = "none"
    # none: top-K of logits + expert bias | sinkhorn: plus a per-expert offset solved on this batch's logits by
    # balance_iters Sinkhorn steps at balance_temperature times the logits' token spread, so the batch's picks
    # spread over the experts (sonic/routing/balance.py)
    balance: str = "none"
    balance_iters: int = 4
    balance_temperature: float = 0.3

    def __post_init__(self):
        ROUTING_BACKENDS.check(self.backend, ("auto",))
        ROUTING_METHODS.check(self.method)
        for field, value, allowed in (("order", self.order, ORDERS),
                                      ("rounding_mode", self.rounding_mode, ROUNDING_MODES),
                                      ("aux_loss_scope", self.aux_loss_scope, AUX_SCOPES),
                                      ("input_centring", self.input_centring, CENTRINGS),
                                      ("logit_norm", self.logit_norm, LOGIT_NORMS),
                                      ("balance", self.balance, BALANCES),
                                      ("bias_update_rule", self.bias_update_rule, BIAS_RULES)):
            if value not in allowed:
                raise ValueError(f"routing.{field}={value!r} is not one of {', '.join(allowed)}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"routing.renormalize={self.renormalize!r} must be true or false")
        if self.renormalize and self.order == "topk_softmax":
            raise ValueError("routing.renormalize=true has no effect with order=topk_softmax (its K gates "
                             "already sum to 1); set order=softmax_topk or renormalize=false")
        if isinstance(self.tile_size, bool) or not isinstance(self.tile_size, int) or self.tile_size < 1:
            raise ValueError(f"routing.tile_size={self.tile_size!r} must be an integer >= 1 (the paper uses 128)")
        if not self.capacity_factor > 0:  # also rejects NaN
            raise ValueError(f"routing.capacity_factor={self.capacity_factor} must be > 0")
        for name in ("aux_loss_coef", "z_loss_coef", "seq_aux_loss_coef", "bias_update_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"routing.{name}={getattr(self, name)} must be >= 0")
        if isinstance(self.balance_iters, bool) or not isinstance(self.balance_iters, int) or self.balance_iters < 1:
            raise ValueError(f"routing.balance_iters={self.balance_iters!r} must be an integer >= 1")
        if not self.balance_temperature > 0:  # also rejects NaN
            raise ValueError(f"routing.balance_temperature={self.balance_temperature} must be > 0 (0.3: near the "
                             "hard assignment; larger: softer, closer to removing each expert's mean logit)")
        if self.method == "expert_choice" and self.balance != "none":
            raise ValueError("routing.balance has no use with method=expert_choice, where every expert already "
                             "takes the same number of tokens; set routing.balance=none")
        if self.method == "expert_choice" and self.bias_update_rate > 0:
            raise ValueError("routing.bias_update_rate > 0 has no use with method=expert_choice, where every "
                             "expert already takes the same number of tokens; set it to 0")
