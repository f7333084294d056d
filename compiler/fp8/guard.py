"""The FP8 numerics guard: did any amax of this step come out inf or NaN?

Dynamic scaling divides by the amax, so one inf or NaN in an operand makes its whole block (with tensorwise
scaling, the whole tensor) meaningless. The recipes report every amax they scale by to an ``AmaxGuard``; the
engine reads the flag with its fp16 overflow vote (``runtime/engine/amp.py``: all-reduced over the world, the step
skipped everywhere) and resets it each step. The flag is a 0-d float32 tensor on the amaxes' device, 1.0 when
a non-finite amax was seen, as ``GradScaler``'s found-inf: updating it never waits for the device.
"""

from __future__ import annotations

import torch


class AmaxGuard:
    def __init__(self) -> None:
        self._found: torch.Tensor | None = None

    def observe(self, amax: torch.Tensor) -> None:
        """Record whether any of ``amax`` (any shape) is inf or NaN."""
        bad = (~torch.isfinite(amax)).any().float()
        self._found = bad if self._found is None else torch.maximum(self._found, bad.to(self._found.device))

    def take(self) -> torch.Tensor | None:
        """The flag since the last call (None if nothing was observed), and start again."""
        found, self._found = self._found, None
        return found
