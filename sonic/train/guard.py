"""Bad steps: keep them out of the weights, the optimizer state and the checkpoints; count them; stop when asked.

A step is bad when its loss or its global gradient norm is not finite, or when its update could
explode the weights: AdamW moves each weight by about lr per step whatever the gradient (at most
~1.2 lr with the default betas), so an update can reach lr·√n for n weights, and a step where
that exceeds train.max_update_ratio × the weight norm ‖w‖ is skipped before it is applied
(optim.lr=1e6 blows the weights up by orders of magnitude in one step whose loss and gradient are
finite, and only later steps go NaN).
Everything is tested on the device, from values that are the same on every rank (the norms are
all-reduced), so all ranks decide alike:

- optim.implementation=fused or triton: the flag goes to torch's fused AdamW (or Sonic's
  TritonAdamW) as `found_inf`, the mechanism GradScaler uses. The kernel leaves parameters,
  exp_avg, exp_avg_sq and AdamW's own step count (its bias correction) untouched when it is
  set. No host sync.
- foreach / for_loop: torch's code paths take no `found_inf` (they assert it is None), so the
  flag is read on the host and optimizer.step() is not called, as GradScaler does for such
  optimizers: one sync per step, on these non-default paths only.

Everything else advances on a skipped step: the step counter (`step` in metrics and
checkpoint names, and train.steps counts skipped steps too), the LR schedule and the data
position; the step's batch is consumed.

train.nonfinite=skip (default) counts skips on the device; the counts are read at log steps
and before a save, and train.max_consecutive_skips consecutive skips stop the run with a
FloatingPointError (whether it stops does not depend on train.log_every, only when). The
trainer saves nothing while a run of skips goes on (see `in_streak`) and keeps the newest
checkpoint written before it (`streak_start`). train.nonfinite=stop reads the flag every step
and raises before the optimizer step.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from sonic.parallel import all_reduce_
from sonic.train.optim import norm_function, optimizer_step, takes_grad_scale

log = logging.getLogger("sonic")

NONFINITE_POLICIES = ("skip", "stop")
# index of each counter in NonFiniteGuard.counts_6
SKIPPED, CONSECUTIVE, TRIPPED_AT, LAST_SKIPPED, EXPLODED, STREAK_START = range(6)
# ‖w‖ moves slowly while the bound it guards (lr·√n, an absurd LR) is off by orders of magnitude when it trips:
# a pass over every weight every step (28 GB at sonic_7b's 40 layers) would cost more than it tells
WEIGHT_NORM_EVERY = 50
_NAMES = ("skipped", "consecutive", "tripped_at", "last_skipped", "exploded", "streak_start")
_FIX = ("lower optim.lr (or raise optim.warmup_steps, or lower optim.grad_clip), or check the data; "
        "train.resume=auto resumes from the newest checkpoint, and a changed optim.lr applies on a resume")


class NonFiniteGuard:
    def __init__(self, optimizer: torch.optim.Optimizer, policy: str, max_consecutive_skips: int,
                 device: torch.device, max_update_ratio: float = 0.0, verbose: bool = True,
                 recovery: Callable[[], str] | None = None):
        assert policy in NONFINITE_POLICIES and max_consecutive_skips >= 1 and max_update_ratio >= 0
        self.optimizer = optimizer
        self.policy = policy
        self.max_consecutive = max_consecutive_skips
        self.max_update_ratio = max_update_ratio
        self.verbose = verbose  # log the warning (rank 0 only)
        self.recovery = recovery or (lambda: f"To recover: {_FIX}")  # the end of the error message
        self.fused = takes_grad_scale(optimizer)  # takes found_inf (and the clip as grad_scale) on the device
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.sqrt_n = math.sqrt(sum(p.numel() for p in self.params))  # global sizes, also of DTensors
        # skipped steps in total, the current run of consecutive skips, the step at which that run
        # first reached max_consecutive (0: never), the last skipped step, the steps skipped for
        # their update size, the first step of the latest run of skips; on the device, no syncs
        self.counts_6 = torch.zeros(6, dtype=torch.int64, device=device)
        self._host = dict.fromkeys(_NAMES, 0)  # the counts as last read by check()
        self._reported = 0  # skips already warned about
        self._weight_norm: torch.Tensor | None = None  # ‖w‖ for the update bound, refreshed every WEIGHT_NORM_EVERY steps

    def step(self, grad_norm: torch.Tensor, step: int, loss: torch.Tensor | None = None,
             grad_scale: torch.Tensor | None = None) -> None:
        """optimizer.step() unless the step is bad; `step` numbers this step (1-based). Call it
        after setting the step's LR: the update bound uses it. `grad_scale`: the clip, for an
        optimizer that applies it in its step (`clip_grad_norm(..., scale_in_step=True)`)."""
        bad = ~torch.isfinite(grad_norm)
        if loss is not None:  # this rank's loss: all ranks must skip alike (an inf loss can have finite grads)
            bad = bad | all_reduce_((~torch.isfinite(loss.detach())).float().reshape(1), "max").bool().reshape(())
        exploding = torch.zeros((), dtype=torch.bool, device=grad_norm.device)
        lr = max(group["lr"] for group in self.optimizer.param_groups)
        if self.max_update_ratio:
            if self._weight_norm is None or step % WEIGHT_NORM_EVERY == 0:  # a pass over every weight: not each step
                self._weight_norm = norm_function(self.optimizer)(self.params).to(grad_norm.device)
            exploding = lr * self.sqrt_n > self.max_update_ratio * self._weight_norm
        found_inf = (bad | exploding).to(torch.float32).reshape(())
        if self.policy == "stop" or not self.fused:
            if found_inf.item():  # host sync: stop, or a path that takes no found_inf
                if self.policy == "stop":
                    if bad.item():
                        what = f"the gradient norm is {grad_norm.item()}" + (
                            f" and the loss {loss.item()}" if loss is not None else "")
                    else:
                        what = (f"the update at LR {lr:.3g} could exceed train.max_update_ratio="
                                f"{self.max_update_ratio} x the weight norm")
                    raise FloatingPointError(
                        f"{what} at step {step} (train.nonfinite=stop); stopped before the optimizer step, so "
                        f"the weights are those after step {step - 1} and nothing was saved after it. "
                        f"{self.recovery()}; or set train.nonfinite=skip to skip such steps")
            else:
                optimizer_step(self.optimizer, grad_scale)
        else:
            optimizer_step(self.optimizer, grad_scale, found_inf)
        self._count(found_inf.to(torch.int64), (exploding & ~bad).to(torch.int64), step)

    def _count(self, found: torch.Tensor, exploding: torch.Tensor, step: int) -> None:
        c = self.counts_6
        starts = found.bool() & (c[CONSECUTIVE] == 0)
        c[STREAK_START] = torch.where(starts, step, c[STREAK_START])
        c[SKIPPED] += found
        c[EXPLODED] += exploding
        c[CONSECUTIVE] = (c[CONSECUTIVE] + 1) * found  # a good step ends the run
        reached = (c[CONSECUTIVE] >= self.max_consecutive) & (c[TRIPPED_AT] == 0)
        c[TRIPPED_AT] = torch.where(reached, step, c[TRIPPED_AT])
        c[LAST_SKIPPED] = torch.where(found.bool(), step, c[LAST_SKIPPED])

    def check(self) -> int:
        """Read the counts (a host sync: at log steps and before saves); warn about new skips and
        raise once max_consecutive_skips steps in a row were skipped. Returns the skipped total."""
        self._host = dict(zip(_NAMES, self.counts_6.tolist()))
        skipped, tripped_at, last, exploded = (self._host[k] for k in ("skipped", "tripped_at", "last_skipped",
                                                                       "exploded"))
        if self.verbose and skipped > self._reported:
            log.warning("skipped %d step(s) with a non-finite loss or gradient norm, or an update that could exceed "
                        "train.max_update_ratio=%g x the weight norm (the last at step %d; %d in total, %d of them "
                        "for their update); their weights and optimizer state were left unchanged",
                        skipped - self._reported, self.max_update_ratio, last, skipped, exploded)
        self._reported = skipped
        if tripped_at:
            raise FloatingPointError(
                f"{self.max_consecutive} consecutive steps up to step {tripped_at} had a non-finite loss or gradient "
                f"norm, or an update that could exceed train.max_update_ratio={self.max_update_ratio} x the weight "
                f"norm ({exploded} of the {skipped} skipped steps; train.max_consecutive_skips="
                f"{self.max_consecutive}): the run is diverging. Nothing was saved after the skips began. "
                f"{self.recovery()}; or raise train.max_consecutive_skips")
        return skipped

    def weight_rms(self) -> float:
        """The root mean square of the weights (a host sync)."""
        return (norm_function(self.optimizer)(self.params) / self.sqrt_n).item()

    @property
    def in_streak(self) -> bool:
        """Whether the last step, as of the last check(), was skipped: the trainer does not save then."""
        return self._host["consecutive"] > 0

    @property
    def streak_start(self) -> int:
        """The first step of the latest run of skips, as of the last check() (0: none yet)."""
        return self._host["streak_start"]

    def state_dict(self) -> dict[str, int]:
        return dict(zip(_NAMES, self.counts_6.tolist()))

    def load_state_dict(self, state: dict[str, int]) -> None:
        state = {name: int(state.get(name, 0)) for name in _NAMES}  # older checkpoints lack the newer counts
        self.counts_6.copy_(torch.tensor([state[name] for name in _NAMES]))
        self._host = state
        self._reported = state["skipped"]
