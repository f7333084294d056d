"""Graceful preemption: a signal on any rank stops every rank at the same step boundary.

SLURM (``--signal``) and Kubernetes send SIGTERM, or a chosen signal, some seconds before they kill a
job; torchrun forwards SIGTERM to its workers. The handler only records the signal. Each step already
all-reduces [grad-norm^2, loss] over the world (runtime/engine/step.py); a third element carries
"a stop was requested here", so every rank learns of any rank's signal in the same step at no extra
collective, and all of them save that step's checkpoint and exit with ``PREEMPTED_EXIT_CODE``.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

# Distinct from 1 (a failure) and 2 (bad input): "stopped on request, a checkpoint of the last step
# is saved; the same command with --resume continues". 75 is EX_TEMPFAIL (sysexits.h): try again later.
PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Whether this process received a stop signal (set from the signal handler)."""

    def __init__(self) -> None:
        self.signal: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum, frame) -> None:
        self.signal = signum


@contextmanager
def stop_on_signals(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[StopRequest]:
    """Record ``signals`` instead of dying of them while the block runs (main thread only)."""
    request = StopRequest()
    previous = {s: signal.signal(s, request._handle) for s in signals}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
