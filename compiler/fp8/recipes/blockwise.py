"""DeepSeek-V3's fine-grained FP8 recipe (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 3.3): e4m3 for
every tensor ("we adopt the E4M3 format on all tensors for higher precision", sec. 3.3.2), online scales
amax / 448 in float32, over 1x128 tiles of activations and output gradients ("per token per 128 channels") and
128x128 blocks of weights ("per 128 input channels per 128 output channels"); the products accumulate each
128-wide K chunk and apply its scales to the float32 partial sum ("increasing accumulation precision").

Tiles run along the axis each product contracts: x and dy in 1x128 tiles for the forward and dgrad, and in 128x1
tiles (128 tokens of one channel) for the weight gradient, where the contraction is over tokens (sec. 3.5.2:
activations are "dequantized, transposed, re-quantized into 128x1 tiles" for the backward; here they are
quantized from the saved high-precision activation, one rounding instead of two). A weight's square blocks serve
both its products. Edge tiles and blocks may be partial.

No amax is shared across shards whose edges are block edges (a multiple of 128 along a sharded dimension;
``Recipe.check_shard``), so TP, cp and FSDP shards need no reduction. torch's ``_scaled_mm`` runs these layouts
only on CUDA SM90 with CUDA 12.9+; this CPU build refuses them, and the recipe runs as its exact emulation there.
"""

from __future__ import annotations

from compiler.fp8.recipe import Recipe
from compiler.fp8.tensor import E4M3, GRAD_OUTPUT, INPUT, ROLES, WEIGHT

TILE = 128

RECIPE = Recipe(
    name="blockwise",
    description="1x128 tiles of activations and gradients, 128x128 weight blocks, amax / 448; e4m3 everywhere",
    source="DeepSeek-V3 technical report sec. 3.3 (fine-grained quantization)",
    dtypes={INPUT: E4M3, WEIGHT: E4M3, GRAD_OUTPUT: E4M3},
    blocks={role: (TILE, TILE) if role.kind == WEIGHT else (1, TILE) if role.axis == 1 else (TILE, 1)
            for role in ROLES},
    power_of_two=False,
    kernel="blockwise",
)
