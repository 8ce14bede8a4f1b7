"""PreemptionGuard answers for the previous step boundary, so it never waits for the step in flight."""
import os
import signal

import torch

from sonic.parallel import PreemptionGuard


def test_a_signal_stops_at_the_next_boundary():
    with PreemptionGuard(torch.device("cpu")) as guard:
        assert not guard.stop_requested() and not guard.stop_requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.received == signal.SIGUSR1
        assert not guard.stop_requested()  # this boundary's flag is read at the next one
        assert guard.stop_requested()
        assert guard.stop_requested()  # and stays set
    assert signal.getsignal(signal.SIGUSR1) is not guard._handle  # the previous handler is back
