"""Python's garbage collector on a schedule, not at random points inside a step.

An automatic collection pauses the rank that runs it for milliseconds to tens of milliseconds, at a
point set by allocation counts; in a pipeline every other rank then waits for it at the next send or
collective, so the pause of one rank becomes everybody's and step times jitter. As torchtitan does,
automatic collection is off during training and a generation-1 collection runs between steps every
``every`` steps (reference cycles live at most that long; tensors are freed by reference counting)."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

GC_EVERY_STEPS = 50


@contextmanager
def garbage_collection_between_steps() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def collect_if_due(step: int, every: int = GC_EVERY_STEPS) -> None:
    """Call after step ``step`` (1-based), outside the timed step."""
    if step % every == 0:
        gc.collect(1)
