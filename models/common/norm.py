"""RMSNorm (Zhang and Sennrich 2019), rounded as Hugging Face's LlamaRMSNorm rounds."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension: the normalisation computed in fp32 and cast back to x's
    dtype, then the weight applied (an fp32 weight makes the product fp32), as LlamaRMSNorm does.

    ``F.rms_norm`` without a weight is exactly that first part (aten's rms_norm upcasts a bf16 / fp16 input to
    fp32 and casts its result back), and it stays one ``aten.rms_norm`` node in the traced graph, so the
    upcast happens at run time whatever dtype the model was traced in. A cast written here in Python
    (``x.float()``, ``type_as``) would be decided at trace time: dropped by the fp32 meta trace, or kept
    as an assertion that x is on the meta device."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., dim) -> normalised in fp32, back in x's dtype -> times the weight
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
