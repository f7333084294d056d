"""The training precisions, one row of facts each. Config validation, autocast, loss scaling, the cost
counter, the planner's models, calibration and the study all read this table; a new precision is one row.

fp16 needs loss scaling (Micikevicius et al. 2018: its 5-bit exponent underflows small gradients); bf16
has fp32's exponent range and needs none (Kalamkar et al. 2019). Both keep fp32 master weights and
optimizer state: autocast casts weights to the low-precision dtype per step (and caches the copies).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    name: str
    autocast_dtype: torch.dtype | None  # forward under torch.autocast to this dtype; None: plain fp32
    loss_scaling: bool  # fp16: scale the loss, unscale gradients, skip steps that overflow
    description: str

    @property
    def dtype(self) -> torch.dtype:
        """The dtype matrix products run in."""
        return self.autocast_dtype or torch.float32

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element exchanged between ranks (TP all-reduces, pipeline sends)."""
        return self.dtype.itemsize

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype)


# fp32 first: searches that compare against full precision measure it first.
PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", None, loss_scaling=False, description="full precision"),
    Precision("bf16", torch.bfloat16, loss_scaling=False, description="autocast to bfloat16, no loss scaling"),
    Precision("fp16", torch.float16, loss_scaling=True,
              description="autocast to float16 + ShardedGradScaler (loss scaling, world-wide overflow vote)"),
)}


def default_precision(*, fast_bf16: bool) -> str:
    """``--precision`` when none is given: bf16 where the device multiplies bf16 matrices fast (runtime/device.py
    ``has_fast_bf16``), as GPU users expect (torchtitan and Megatron default to it), else fp32. Never fp16 by
    default: its 5-bit exponent needs loss scaling, and its residual stream overflows sooner; it stays one
    flag away (``--precision fp16``) with every guarantee of its own."""
    return "bf16" if fast_bf16 else "fp32"
