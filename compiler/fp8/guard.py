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
        self._seen: list[torch.Tensor] = []  # one 0-d bool per observation since the last take()

    def observe(self, amax: torch.Tensor) -> None:
        """Record whether any of ``amax`` (any shape) is inf or NaN. The same ops on every call, whatever was seen
        before: selective activation checkpointing numbers a block's op calls, and its recomputation (which finds
        earlier observations) must make the calls the forward made."""
        self._seen.append((~torch.isfinite(amax)).any())

    def take(self) -> torch.Tensor | None:
        """The flag since the last call (None if nothing was observed), and start again."""
        seen, self._seen = self._seen, []
        if not seen:
            return None
        return torch.stack([bad.to(seen[0].device) for bad in seen]).any().float()
