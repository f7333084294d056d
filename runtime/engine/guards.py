"""Divergence guards: stop a run that has silently stopped learning, before it overwrites a good checkpoint.

fp32 / bf16: a step whose global loss or gradient norm is not finite would write NaN into every weight,
so the trainer skips its update (like fp16's scaler does) and the guard counts it, as it counts a step skipped
for an inf or NaN FP8 amax (--fp8); ``max_bad_steps``
such steps in a row stop the run. One bad batch is survivable, a broken model is not.

fp16: the grad scaler already skips overflowing steps and halves the loss scale. A few skips are how
it finds its scale; a long run of them, or a scale that keeps halving below a floor, means the
gradients overflow at any scale (the model has diverged). More than ``max_bad_steps`` skipped steps in
a row, or a loss scale below ``min_loss_scale``, stop the run.

Every rank sees the same all-reduced loss, gradient norm and world-wide overflow vote, so every rank
reaches the same decision at the same step without any extra communication. The decision is made
before a checkpoint would be written, so a stopped run never replaces the last good checkpoint.
Steps are 1-based here, as in the progress line ("step 20/30").
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class DivergenceError(RuntimeError):
    """The run diverged; the message names the step and what went wrong."""


@dataclass
class DivergenceGuard:
    max_bad_steps: int
    min_loss_scale: float
    loss_scaling: bool  # fp16: watch skips and the scale; otherwise watch for non-finite values
    streak: int = 0  # consecutive bad (fp32/bf16) or skipped (fp16) steps up to the last one observed
    streak_start: int = 0  # first step of the current streak

    def observe(self, step: int, *, loss: float, grad_norm: float, skipped: bool, loss_scale: float) -> None:
        """Record the outcome of ``step``; raise DivergenceError if the run must stop.

        ``loss_scale`` is the fp16 scale after this step's update (ignored without loss scaling).
        """
        # Without loss scaling a step is skipped for a non-finite loss or norm, or for a non-finite FP8 amax (--fp8).
        bad = skipped if self.loss_scaling else skipped or not (math.isfinite(loss) and math.isfinite(grad_norm))
        if bad:
            self.streak_start = step if self.streak == 0 else self.streak_start
            self.streak += 1
        else:
            self.streak = 0
        if self.loss_scaling:
            if loss_scale < self.min_loss_scale:
                raise DivergenceError(
                    f"training diverged at step {step}: the fp16 loss scale fell to {loss_scale:g}, below "
                    f"--min-loss-scale {self.min_loss_scale:g} (gradients overflow at any scale)")
            if self.streak > self.max_bad_steps:
                raise DivergenceError(
                    f"training diverged at step {step}: {self.streak} consecutive fp16 steps skipped for "
                    f"overflowing gradients (steps {self.streak_start}-{step}), more than --max-bad-steps "
                    f"{self.max_bad_steps}; loss scale now {loss_scale:g}")
        elif self.streak >= self.max_bad_steps:
            raise DivergenceError(
                f"training diverged at step {step}: non-finite loss, gradient norm or FP8 amax for {self.streak} "
                f"consecutive step(s) (steps {self.streak_start}-{step}, --max-bad-steps {self.max_bad_steps}); last: loss "
                f"{loss}, gradient norm {grad_norm}")

    @property
    def weights_trustworthy(self) -> bool:
        """Whether a checkpoint may be written now: never in the middle of a run of non-finite steps.

        fp16 skipped steps leave the weights untouched, so they do not block a checkpoint.
        """
        return self.loss_scaling or self.streak == 0

    def state_dict(self) -> dict:
        return {"streak": self.streak, "streak_start": self.streak_start}

    def load_state_dict(self, state: dict) -> None:
        self.streak, self.streak_start = int(state["streak"]), int(state["streak_start"])
