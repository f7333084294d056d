"""The SwiGLU MLP (Shazeer 2020), used as a dense block's MLP and as a mixture's shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """down(silu(gate x) * up x), no biases: gate and up (D -> F), down (F -> D)."""

    def __init__(self, d_model: int, width: int):
        super().__init__()
        self.gate = nn.Linear(d_model, width, bias=False)
        self.up = nn.Linear(d_model, width, bias=False)
        self.down = nn.Linear(width, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
