"""Tests reach into a training step through the engine's own seam, not through hooks in product code:
``after_backward(hook)`` makes every training step call ``hook(step, ctx)`` (its ``StepContext``) once the
schedule has run every micro-batch's forward and backward, before gradients are unscaled, clipped and applied.

Call it inside a spawned rank before ``run.main``; it patches ``runtime.engine.step.forward_backward`` in
that process only. ``step`` is the 0-based global step: the LR schedule's position when the process
starts (so it continues across a resume) plus the steps this process has run. The schedule alone would
repeat a number after an fp16-skipped step, which does not move it.
"""

from __future__ import annotations

import weakref
from typing import Callable

from runtime.engine import step as step_module


def after_backward(hook: Callable[[int, "step_module.StepContext"], None]) -> None:
    original = step_module.forward_backward
    run: dict = {}  # this run's step context, the schedule's position at its first step, steps run so far

    def forward_backward_then_hook(ctx, inputs, targets):
        losses = original(ctx, inputs, targets)
        if run.get("ctx", lambda: None)() is not ctx:  # a new run in this process (tests train several in one)
            run.update(ctx=weakref.ref(ctx), start=ctx.lr_schedule.last_epoch, steps=0)
        hook(run["start"] + run["steps"], ctx)
        run["steps"] += 1
        return losses

    step_module.forward_backward = forward_backward_then_hook
