"""Timeouts by phase: how long a rank waits on its peers depends on what the job is doing.

Every wait on a peer (a collective, a pipeline send or receive) is bounded by its process group's timeout,
and past it the rank reports a lost peer (runtime/distributed/failures.py, exit 3). What is a sane bound
differs by phase:

- start-up: process groups, the model's materialisation and its stages' tracing, ``--compile`` (traced on
  the first forward), the first step (the pipeline's warm-up, NCCL communicators, DCP planning) and the
  first validation pass: one rank may be minutes behind another, and that is no failure;
- steady steps: every later step and validation, which take seconds; a rank minutes late is stuck;
- checkpoint I/O: saving, publishing and loading, as slow as the file system of the slowest rank.

So each phase has its own flag (torchtitan likewise keeps ``comm.init_timeout_seconds``, for initialisation
and the first step, apart from ``comm.train_timeout_seconds``), and ``PhaseTimeouts`` sets every process group
of the rank to its phase's timeout as it enters the phase. A group's timeout is read when an operation starts
(compiler/torch_compat.py ``set_group_timeout``), so a switch takes effect from the next operation on: NCCL
copies it into every work; gloo's collectives read it, while its sends and receives keep the bound the group
connected with unless their wait is given one, which the pipeline's and the tied embedding's are
(``bounded_p2p_works``). An error escaping a phase is tagged with it (an exception note, as the loop tags the
step), so the error line names the phase and its flag.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Iterator

import torch.distributed as dist

from compiler.torch_compat import bound_pipeline_p2p_waits, process_groups, set_group_timeout

# Defaults. Start-up: torch's own default for a gloo group (30 min), time for a large model's weights to be
# read and compiled on every rank. Checkpoints: the same, for a slow or shared file system.
DEFAULT_STARTUP_TIMEOUT_S = 1800.0
DEFAULT_CHECKPOINT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Phase:
    name: str  # as the error line says it
    flag: str  # the flag bounding its waits
    covers: str  # what it is made of


STARTUP = Phase("start-up", "--startup-timeout",
                "process groups, tracing, --compile, the first step and the first validation")
STEADY = Phase("steady steps", "--collective-timeout", "every later step and validation")
CHECKPOINT = Phase("checkpoint I/O", "--checkpoint-timeout", "saving, publishing and loading checkpoints")
PHASES = (STARTUP, STEADY, CHECKPOINT)
_NOTE = "phase: "


@dataclass(frozen=True)
class Timeouts:
    """Seconds each phase waits on a peer before giving up."""

    startup_s: float
    steady_s: float
    checkpoint_s: float

    def of(self, phase: Phase) -> float:
        return {STARTUP: self.startup_s, STEADY: self.steady_s, CHECKPOINT: self.checkpoint_s}[phase]


def noted_phase(error: BaseException) -> Phase | None:
    """The phase ``error`` escaped from (the innermost), if it was tagged."""
    names = [note[len(_NOTE):] for note in getattr(error, "__notes__", []) if note.startswith(_NOTE)]
    return next((p for p in PHASES if names and p.name == names[0]), None)


def _note(error: BaseException, phase: Phase) -> None:
    if noted_phase(error) is None:
        error.add_note(_NOTE + phase.name)


class PhaseTimeouts:
    """The phase this rank is in, every process group it waits on bounded by that phase's timeout.

    Starts in start-up. ``exempt`` groups keep the
    timeout they were made with: the background checkpoint writer's group is always in checkpoint I/O,
    whatever the training thread is doing."""

    def __init__(self, timeouts: Timeouts):
        self.timeouts = timeouts
        self._exempt: list[dist.ProcessGroup] = []
        self.switch(STARTUP)  # the world's group too, whatever it was made with
        bound_pipeline_p2p_waits()  # gloo's sends and receives too (compiler/torch_compat.py)

    def exempt(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        self._exempt.append(group)
        return group

    def switch(self, phase: Phase) -> None:
        """Enter ``phase``: every group (made so far) waits at most its timeout from the next operation on."""
        timeout = datetime.timedelta(seconds=self.timeouts.of(phase))
        for group in process_groups():
            if not any(group is kept for kept in self._exempt):
                set_group_timeout(group, timeout)
        self.current = phase

    @contextlib.contextmanager
    def during(self, phase: Phase) -> Iterator[None]:
        """Run the block in ``phase``, then go back to the phase before; an error leaving it is tagged."""
        previous = self.current
        self.switch(phase)
        try:
            yield
        except RuntimeError as e:
            _note(e, phase)
            raise
        self.switch(previous)

    @contextlib.contextmanager
    def noting(self) -> Iterator[None]:
        """Tag an error escaping the block with the phase it happened in (where ``during`` did not)."""
        try:
            yield
        except RuntimeError as e:
            _note(e, self.current)
            raise
