"""One line for a rank that stopped hearing from its peers, instead of gloo's traceback.

A stuck or dead rank leaves its peers waiting in a point-to-point transfer or a collective. Every wait is
bounded by the process groups' timeout (``--collective-timeout``); when it fires, gloo raises
``RuntimeError: ... Timed out waiting 30000ms for recv operation to complete``, and the ranks that were
waiting on *those* ranks then see ``Connection closed by peer``. ``describe_peer_failure`` turns either into
a line naming the rank, the step, the operation, what the rank was doing (read off the traceback) and the
peers it was exchanging with.
"""

from __future__ import annotations

import re
import traceback

from runtime.distributed.mesh import GridLayout

# A rank gave up on its peers (a timeout, or a peer's connection lost): distinct from 1 (a failed save or
# divergence), 2 (bad input) and 75 (preempted).
PEER_FAILURE_EXIT_CODE = 3
_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation")
_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")

# (function in the traceback, what the rank was doing, whose ranks it waited on)
_ACTIVITIES = (
    ("begin_save", "saving a checkpoint", "world"),
    ("finish_save", "publishing a checkpoint", "world"),
    ("evaluate", "validation through the pipeline", "pp"),
    ("_optimizer_step", "the step's all-reduce of the gradient norm and loss", "world"),
    ("unscale_", "the fp16 overflow vote", "world"),
    ("sync_grads", "summing the tied embedding's gradients", "pp"),
    ("finish", "the replicas' gradient all-reduce", "dp"),
    ("step", "the pipeline schedule (activations and gradients with the pipeline peers, TP and FSDP collectives)", "pp"),
)


def describe_peer_failure(error: BaseException, *, rank: int, layout: GridLayout, timeout_s: float) -> str | None:
    """The error line for a lost or silent peer, or None if ``error`` is something else."""
    text = "\n".join(str(e) for e in _chain(error))  # pipelining re-raises a stage's error from it
    timed_out = _TIMEOUT.search(text)
    if not timed_out and not any(s in text for s in _LOST):
        return None
    frames = {f.name for f in traceback.extract_tb(error.__traceback__)}
    activity, group = next(((what, g) for name, what, g in _ACTIVITIES if name in frames),
                           ("start-up or a collective", "world"))
    step = next((note for note in getattr(error, "__notes__", []) if note.startswith("step ")), "start-up")
    peers = _peers(rank, layout, group)
    if timed_out:
        what = f"{timed_out.group(2)} timed out after {int(timed_out.group(1)) / 1000:g} s (--collective-timeout {timeout_s:g})"
    else:
        what = "a peer rank closed its connection (it exited or was killed)"
    return f"rank {rank}: {what} in {step}, during {activity}; waiting on {peers}"


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from (``__cause__``/``__context__``), outermost first."""
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _peers(rank: int, layout: GridLayout, group: str) -> str:
    dp, pp, mp = layout.coordinates(rank)
    if group == "pp" and layout.pp > 1:
        return "pipeline peers " + ", ".join(str(layout.rank(dp, p, mp)) for p in range(layout.pp) if p != pp)
    if group == "dp" and layout.dp > 1:
        return "replica peers " + ", ".join(str(layout.rank(d, pp, mp)) for d in range(layout.dp) if d != dp)
    return f"all {layout.dp * layout.pp * layout.mp} ranks"
