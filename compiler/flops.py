"""Model FLOPs per token: the numerator of MFU and of the planner's throughput.

Each family states its own count (its ``ModelSpec.flops_per_token``): 6 N + attention, after PaLM
(Chowdhery et al. 2022, appendix B) and Megatron-LM (Narayanan et al. 2021, sec. 5.1) without
recomputation, N being the parameters that take part in matrix products (blocks and LM head, not the
embedding lookups). MFU measures useful model work, not work done.
"""

from __future__ import annotations

from models import flops_per_token


def training_flops_per_token(cfg) -> float:
    return flops_per_token(cfg)
