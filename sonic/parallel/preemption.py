"""Preemption: on SIGUSR1, SIGUSR2 or SIGTERM, every rank stops at the same step boundary.

Who sends what: Slurm sends SIGUSR1 ahead of the time limit (`--signal=B:USR1@N`;
scripts/slurm/train.sbatch forwards it through srun and torchrun), submitit sends SIGUSR2
(Hydra's submitit launcher), and Slurm sends SIGTERM on scancel, requeue or preemption.

The handler only records the signal; `stop_requested()` takes the MAX of that flag over all
ranks at a step boundary, so all ranks save the same step and leave together even when the
signal reached them during different steps. It answers for the previous step boundary:
reading the current one would wait for the GPU to finish the step just queued, every step, and
keep the host from queueing the next one ahead (the host's launches are ~14% of a step).
Once the run has saved and cleaned up, `hand_on()` calls the handler that was installed before
ours, if any: submitit's requeues the job and exits.
"""
from __future__ import annotations

import logging
import signal
import threading

import torch

from sonic.parallel.distributed import all_reduce_

log = logging.getLogger("sonic")

SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)


class PreemptionGuard:
    """Context manager: installs the handlers on entry and restores the previous ones on exit."""

    def __init__(self, device: torch.device):
        self.device = device
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._pending = None  # the last boundary's all-ranks flag (host copy, its CUDA event)

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: preemption signals will not trigger a checkpoint")
            return self
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum)

    def stop_requested(self) -> bool:
        """True on every rank once any rank had a signal by the previous call (a collective: call on
        all ranks at every step boundary). The reduction queued here is read at the next call, by
        when the GPU has long finished it, so no call waits for the step in flight."""
        flag = torch.full((1,), 0.0 if self.received is None else 1.0, device=self.device)  # no host copy
        host = all_reduce_(flag, "max").to("cpu", non_blocking=True)
        ready = torch.cuda.Event() if self.device.type == "cuda" else None
        if ready is not None:
            ready.record()
        previous, self._pending = self._pending, (host, ready)
        if previous is None:
            return False
        host, ready = previous
        if ready is not None:
            ready.synchronize()
        return bool(host.item())

    def hand_on(self) -> None:
        """Pass the signal this rank got to the handler installed before ours (e.g. submitit's)."""
        previous = self._previous.get(self.received)
        if callable(previous):
            previous(self.received, None)
