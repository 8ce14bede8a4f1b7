"""Non-finite steps: keep them out of the weights and the optimizer state, count them, stop when asked.

Every step the global gradient norm (after clipping's all-reduce: the same on every rank, so
all ranks decide alike) is tested on the device:

- optim.implementation=fused: the flag goes to torch's fused AdamW as `found_inf`, the
  mechanism GradScaler uses. The kernel leaves parameters, exp_avg, exp_avg_sq and AdamW's
  own step count (its bias correction) untouched when it is set. No host sync.
- foreach / for_loop: torch's code paths take no `found_inf` (they assert it is None), so the
  flag is read on the host and optimizer.step() is not called, as GradScaler does for such
  optimizers: one sync per step, on these non-default paths only.

Everything else advances on a skipped step: the step counter (`step` in metrics and
checkpoint names, and train.steps counts skipped steps too), the LR schedule and the data
position; the step's batch is consumed. Stepping the schedule regardless keeps the loop
free of host syncs, and a resumed run sees the same schedule.

train.nonfinite=skip (default) counts skips on the device; the counts are read at log steps
and before a save, and train.max_consecutive_skips consecutive skips stop the run with a
FloatingPointError (whether it stops does not depend on train.log_every, only when).
train.nonfinite=stop reads the flag every step and raises before the optimizer step.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("sonic")

NONFINITE_POLICIES = ("skip", "stop")
# index of each counter in NonFiniteGuard.counts_4
SKIPPED, CONSECUTIVE, TRIPPED_AT, LAST_SKIPPED = range(4)
_NAMES = ("skipped", "consecutive", "tripped_at", "last_skipped")
_FIX = "lower optim.lr (or raise optim.warmup_steps, or lower optim.grad_clip), or check the data"


class NonFiniteGuard:
    def __init__(self, optimizer: torch.optim.Optimizer, policy: str, max_consecutive_skips: int,
                 device: torch.device, verbose: bool = True):
        assert policy in NONFINITE_POLICIES and max_consecutive_skips >= 1, (policy, max_consecutive_skips)
        self.optimizer = optimizer
        self.policy = policy
        self.max_consecutive = max_consecutive_skips
        self.verbose = verbose  # log the warning (rank 0 only)
        self.fused = all(group.get("fused") for group in optimizer.param_groups)
        # skipped steps in total, the current run of consecutive skips, the step at which that run
        # first reached max_consecutive (0: never), the last skipped step; on the device, no syncs
        self.counts_4 = torch.zeros(4, dtype=torch.int64, device=device)
        self._reported = 0  # skips already warned about

    def step(self, grad_norm: torch.Tensor, step: int) -> None:
        """optimizer.step() unless grad_norm is non-finite; `step` numbers this step (1-based)."""
        found_inf = (~torch.isfinite(grad_norm)).to(torch.float32).reshape(())
        if self.policy == "stop" or not self.fused:
            if found_inf.item():  # host sync: stop, or a path that takes no found_inf
                if self.policy == "stop":
                    raise FloatingPointError(
                        f"the gradient norm is {grad_norm.item()} at step {step} (train.nonfinite=stop); stopped "
                        f"before the optimizer step, so the weights are those after step {step - 1} and nothing "
                        f"was saved after it. To fix: {_FIX}; or set train.nonfinite=skip to skip "
                        f"such steps")
            else:
                self.optimizer.step()
        else:
            self.optimizer.found_inf = found_inf  # read by the fused kernel, as GradScaler passes it
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        self._count(found_inf.to(torch.int64), step)

    def _count(self, found: torch.Tensor, step: int) -> None:
        c = self.counts_4
        c[SKIPPED] += found
        c[CONSECUTIVE] = (c[CONSECUTIVE] + 1) * found  # a good step ends the run
        reached = (c[CONSECUTIVE] >= self.max_consecutive) & (c[TRIPPED_AT] == 0)
        c[TRIPPED_AT] = torch.where(reached, step, c[TRIPPED_AT])
        c[LAST_SKIPPED] = torch.where(found.bool(), step, c[LAST_SKIPPED])

    def check(self) -> int:
        """Read the counts (a host sync: at log steps and before saves); warn about new skips and
        raise once max_consecutive_skips steps in a row were skipped. Returns the skipped total."""
        skipped, _, tripped_at, last = self.counts_4.tolist()
        if self.verbose and skipped > self._reported:
            log.warning("skipped %d step(s) with a non-finite gradient norm (the last at step %d, %d in total); "
                        "their weights and optimizer state were left unchanged", skipped - self._reported, last,
                        skipped)
        self._reported = skipped
        if tripped_at:
            raise FloatingPointError(
                f"{self.max_consecutive} consecutive steps up to step {tripped_at} had a non-finite gradient norm "
                f"(train.max_consecutive_skips={self.max_consecutive}; {skipped} skipped in total): the run is "
                f"diverging or its weights overflowed. Resume from the last checkpoint (train.resume=auto) and "
                f"{_FIX}, or raise train.max_consecutive_skips")
        return skipped

    def state_dict(self) -> dict[str, int]:
        return dict(zip(_NAMES, self.counts_4.tolist()))

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.counts_4.copy_(torch.tensor([state[name] for name in _NAMES]))
        self._reported = state["skipped"]

