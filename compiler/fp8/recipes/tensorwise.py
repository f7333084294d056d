"""torchao's Float8 "tensorwise" recipe with dynamic scaling (torchao float8/config.py ``Float8LinearConfig()``,
``Float8LinearRecipeName.TENSORWISE``): one float32 scale per tensor, amax / fp8_max, recomputed every step; e4m3
(max 448) for inputs and weights, e5m2 (max 57344) for output gradients, whose range matters more than their
precision (Micikevicius et al. 2022, "FP8 formats for deep learning"). Not rounded to powers of two (torchao's
default ``round_scales_to_power_of_2=False``).

One quantization of a tensor serves both products it enters (its block is the whole tensor whatever the axis), so
every shard of a tensor must take the MAX of all shards' amaxes: x over tokens (cp) and features (a row-parallel
input), W over both of its dimensions (TP, and FSDP when weights are quantized before their all-gather), dy alike.
torch's ``_scaled_mm`` runs it on CPU and CUDA (SM89+) with 0-d scales.
"""

from __future__ import annotations

from compiler.fp8.recipe import FULL, Recipe
from compiler.fp8.tensor import E4M3, E5M2, GRAD_OUTPUT, INPUT, ROLES, WEIGHT

RECIPE = Recipe(
    name="tensorwise",
    description="one scale per tensor (amax / fp8_max); e4m3 inputs and weights, e5m2 output gradients",
    source="torchao float8 Float8LinearConfig() (recipe 'tensorwise'), dynamic scaling",
    dtypes={INPUT: E4M3, WEIGHT: E4M3, GRAD_OUTPUT: E5M2},
    blocks={role: (FULL, FULL) for role in ROLES},
    power_of_two=False,
    kernel="tensorwise",
)
