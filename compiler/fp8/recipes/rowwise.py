"""torchao's Float8 "rowwise" recipe (torchao float8/config.py ``Float8LinearConfig.from_recipe_name("rowwise")``):
every operand of every product is scaled along the axis that product contracts, one float32 scale per row of the
left operand and per column of the right one; e4m3 for all three tensors, output gradients included (that
recipe sets ``target_dtype=e4m3_dtype`` on ``cast_config_grad_output``, overriding the e5m2 default); scales
rounded to powers of two (``round_scales_to_power_of_2=True``, "enable power of 2 scaling factors by default for
row-wise scaling").

For y = x W^T, dx = dy W, dW = dy^T x (tensor.py's roles), each tensor is quantized once per product:

    forward  x: one scale per token (amax over K)          W: one per output row (amax over K)
    dgrad    dy: one per token (amax over N)                W: one per input column (amax over N)
    wgrad    dy: one per output feature (amax over tokens)  x: one per input feature (amax over tokens)

A shard must reduce (MAX) its amaxes over the other shards only along the contracted axis: a column-parallel W
(rows sharded over TP) needs none in the forward and a MAX over TP in dgrad; a row-parallel x (K sharded) a MAX
over TP in the forward; x and dy sharded by tokens (cp) a MAX over cp in wgrad. torch's ``_scaled_mm`` runs it on
CPU and on CUDA SM89+ with (M, 1) and (1, N) scales (float32 output only with cuBLAS 12.9+ on SM90).
"""

from __future__ import annotations

from compiler.fp8.recipe import FULL, Recipe
from compiler.fp8.tensor import E4M3, GRAD_OUTPUT, INPUT, ROLES, WEIGHT

RECIPE = Recipe(
    name="rowwise",
    description="one scale per row / column along each product's contraction, powers of two; e4m3 everywhere",
    source="torchao float8 Float8LinearConfig.from_recipe_name('rowwise')",
    dtypes={INPUT: E4M3, WEIGHT: E4M3, GRAD_OUTPUT: E4M3},
    # axis 1 contracted: a scale per row, its block the whole row; axis 0: per column.
    blocks={role: (1, FULL) if role.axis == 1 else (FULL, 1) for role in ROLES},
    power_of_two=True,
    kernel="rowwise",
)
