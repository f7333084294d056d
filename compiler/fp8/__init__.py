"""FP8 training numerics: the recipes (``RECIPES``, one file each in recipes/), the FP8 linear and its module swap,
the experts' grouped product, and the numerics guard. compiler/fp8/README.md says what is exact and how scales are
reduced over shards."""

from __future__ import annotations

from compiler.fp8.grouped import fp8_experts_compute, fp8_experts_swiglu, fp8_grouped_mm, swap_grouped_experts
from compiler.fp8.guard import AmaxGuard
from compiler.fp8.linear import LinearShards, Shards, fp8_linear
from compiler.fp8.modules import Float8Linear, keep_high_precision, swap_linears
from compiler.fp8.recipe import Recipe
from compiler.fp8.recipes import blockwise, rowwise, tensorwise
from compiler.fp8.tensor import Fp8Tensor, Role

RECIPES: dict[str, Recipe] = {r.name: r for r in (tensorwise.RECIPE, rowwise.RECIPE, blockwise.RECIPE)}

__all__ = ["RECIPES", "AmaxGuard", "Float8Linear", "Fp8Tensor", "LinearShards", "Recipe", "Role", "Shards",
           "fp8_experts_compute", "fp8_experts_swiglu", "fp8_grouped_mm", "fp8_linear", "keep_high_precision",
           "swap_grouped_experts", "swap_linears"]
