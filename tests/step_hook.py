"""Tests reach into a training step through the engine's own seam, not through hooks in product code:
``after_backward(hook)`` makes every training step call ``hook(step, ctx)`` once the schedule has run
every micro-batch's forward and backward, before gradients are unscaled, clipped and applied.

Call it inside a spawned rank before ``run.main``; it patches ``runtime.engine.step.run_schedule`` in
that process only. ``step`` is the 0-based global step: the LR schedule's position when the process
starts (so it continues across a resume) plus the steps this process has run. The schedule alone would
repeat a number after an fp16-skipped step, which does not move it.
"""

from __future__ import annotations

from typing import Callable

from runtime.engine import step as step_module


def after_backward(hook: Callable[[int, "step_module.StepContext"], None]) -> None:
    original = step_module.run_schedule
    run_here: list[int] = []  # [the schedule's position at the first step, steps run so far]

    def run_schedule_then_hook(ctx, inputs, targets, *, train: bool):
        losses = original(ctx, inputs, targets, train=train)
        if train:
            if not run_here:
                run_here.extend([ctx.lr_schedule.last_epoch, 0])
            hook(run_here[0] + run_here[1], ctx)
            run_here[1] += 1
        return losses

    step_module.run_schedule = run_schedule_then_hook
