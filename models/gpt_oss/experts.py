"""gpt-oss's experts: the clamped SwiGLU with biases, as the mixture block's swappable expert computation
(models/common/moe.py ``experts``: rows sorted by expert in, their outputs out).

Parameters, stacked as the released files store them (input-major, x @ W; Hugging Face's GptOssExperts):
``gate_up_proj`` (E, D, 2F) with gate and up interleaved along the last axis (gate = columns 0, 2, 4 ..., up =
1, 3, 5 ...), ``gate_up_proj_bias`` (E, 2F), ``down_proj`` (E, F, D), ``down_proj_bias`` (E, D); dim 0 is the expert
for all four, so expert parallelism hands each rank its experts' biases with their matrices. Per expert::

    h    = x @ W_gu + b_gu                       (2F,)
    gate = min(h[0::2], limit),  up = clamp(h[1::2], -limit, limit)
    out  = ((up + 1) * gate * sigmoid(alpha * gate)) @ W_down + b_down

(``swiglu_limit`` 7 and ``swiglu_alpha`` 1.702 in the released configs); the mixture then weighs it by the routing
weight. The products are the grouped products of models/common/grouped_mm.py on the transposed views (E, 2F, D) and
(E, D, F) of the stored tensors; each row's bias is its expert's, found from the cumulative counts.
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.grouped_mm import grouped_mm
from models.common.moe import autocast_dtype


def expert_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows,) the expert of each row for cumulative row counts ``offsets`` (E,) int32: expert e holds rows
    offsets[e-1] .. offsets[e] - 1. Rows past offsets[-1] (padding, which gives zeros) get E - 1."""
    index = torch.ones_like(offsets[:1]).expand(rows).cumsum(0, dtype=offsets.dtype) - 1  # 0 .. rows-1, derived from the input
    return torch.searchsorted(offsets, index, right=True).clamp(max=offsets.shape[0] - 1)


def clamped_swiglu_experts(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor,
                           down: torch.Tensor, down_bias: torch.Tensor, *, limit: float, alpha: float) -> torch.Tensor:
    """E clamped-SwiGLU experts on rows sorted by expert: x (M, D), counts (E,) rows per expert (their sum M),
    the stacked parameters of the module docstring -> (M, D). Under autocast the experts compute in its dtype."""
    offsets = counts.cumsum(0, dtype=torch.int32)  # (E,) where each expert's rows end
    dtype = autocast_dtype(x.device.type)
    if dtype is not None:  # the grouped product is not on autocast's lists: cast as autocast would
        x, gate_up, gate_up_bias, down, down_bias = (t.to(dtype) for t in (x, gate_up, gate_up_bias, down, down_bias))
    expert = expert_of_rows(offsets, x.shape[0])  # (M,)
    h = grouped_mm(x, gate_up.transpose(1, 2), offsets) + gate_up_bias[expert]  # (M, 2F)
    gate, up = h[:, 0::2].clamp(max=limit), h[:, 1::2].clamp(-limit, limit)  # (M, F) each
    a = (up + 1) * (gate * torch.sigmoid(gate * alpha))  # in transformers' order of operations
    return grouped_mm(a, down.transpose(1, 2), offsets) + down_bias[expert]  # (M, D)


class ClampedSwiGLUExperts(nn.Module):
    """E experts of width F over d_model D (module docstring); ``forward(x, counts)`` on rows sorted by expert."""

    def __init__(self, d_model: int, width: int, n_experts: int, *, limit: float, alpha: float):
        super().__init__()
        self.n_experts, self.limit, self.alpha = n_experts, limit, alpha
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, d_model, 2 * width).normal_(std=0.02))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(n_experts, 2 * width))
        self.down_proj = nn.Parameter(torch.empty(n_experts, width, d_model).normal_(std=0.02))
        self.down_proj_bias = nn.Parameter(torch.zeros(n_experts, d_model))

    def compute(self, x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor,
                down: torch.Tensor, down_bias: torch.Tensor) -> torch.Tensor:
        """The experts given their parameters (this module's, or a rank's local experts' under expert parallelism)."""
        return clamped_swiglu_experts(x, counts, gate_up, gate_up_bias, down, down_bias, limit=self.limit,
                                      alpha=self.alpha)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.compute(x, counts, self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias)
