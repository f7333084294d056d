"""Tests reach into a training step through the engine's own seam, not through hooks in product code:
``after_backward(hook)`` makes every training step call ``hook(step, ctx)`` once the schedule has run
every micro-batch's forward and backward, before gradients are unscaled, clipped and applied.

Call it inside a spawned rank before ``run.main``; it patches ``runtime.engine.step.run_schedule`` in
that process only. ``step`` is the 0-based global step (the LR schedule's position, so it continues
across a resume).
"""

from __future__ import annotations

from typing import Callable

from runtime.engine import step as step_module


def after_backward(hook: Callable[[int, "step_module.StepContext"], None]) -> None:
    original = step_module.run_schedule

    def run_schedule_then_hook(ctx, inputs, targets, *, train: bool):
        losses = original(ctx, inputs, targets, train=train)
        if train:
            hook(ctx.lr_schedule.last_epoch, ctx)
        return losses

    step_module.run_schedule = run_schedule_then_hook
