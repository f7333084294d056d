"""What a quantized operand is: FP8 values on a grid of blocks, one float32 scale per block, and the role the
operand plays in its matrix product.

One representation serves every recipe. An ``Fp8Tensor`` of shape (R, C) with block (br, bc) holds ``data`` (R, C)
in an FP8 dtype and ``scale`` (ceil(R / br), ceil(C / bc)) in float32; element (i, j) stands for
``data[i, j] * scale[i // br, j // bc]``. Edge blocks may be partial. Tensorwise scaling is the block (R, C) (one
scale); rowwise is (1, C) or (R, 1); DeepSeek-V3's tiles and blocks are (1, 128), (128, 1) and (128, 128).

Roles. A linear layer y = x W^T (x (M, K) tokens x inputs, W (N, K), dy (M, N)) runs three products, and each
operand is contracted along one axis of its own layout (torchao float8_linear.py ``matmul_with_hp_or_float8_args``
scales each operand along that axis for its rowwise recipe):

    forward  y  = x   @ W^T : x contracted on axis 1 (K), W on axis 1 (K)
    dgrad    dx = dy  @ W   : dy on axis 1 (N),            W on axis 0 (N)
    wgrad    dW = dy^T @ x  : dy on axis 0 (M, tokens),     x on axis 0 (M, tokens)

A recipe's block for an operand depends on its kind (input, weight, output gradient) and that axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# The largest finite value of each format (OCP 8-bit floating point spec, 2023; torch.finfo(dtype).max).
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}

INPUT, WEIGHT, GRAD_OUTPUT = "input", "weight", "grad_output"


@dataclass(frozen=True)
class Role:
    """An operand of one product: its kind and the axis of its own (R, C) layout the product contracts."""

    kind: str  # INPUT, WEIGHT or GRAD_OUTPUT
    axis: int  # 0 or 1


INPUT_FORWARD, WEIGHT_FORWARD = Role(INPUT, 1), Role(WEIGHT, 1)
GRAD_DGRAD, WEIGHT_DGRAD = Role(GRAD_OUTPUT, 1), Role(WEIGHT, 0)
GRAD_WGRAD, INPUT_WGRAD = Role(GRAD_OUTPUT, 0), Role(INPUT, 0)
ROLES = (INPUT_FORWARD, WEIGHT_FORWARD, GRAD_DGRAD, WEIGHT_DGRAD, GRAD_WGRAD, INPUT_WGRAD)


def grid_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a (R, C) tensor cut into (br, bc) blocks, partial edge blocks included."""
    return tuple(-(-n // b) for n, b in zip(shape, block))


@dataclass(frozen=True)
class Fp8Tensor:
    data: torch.Tensor  # (R, C) float8_e4m3fn or float8_e5m2
    scale: torch.Tensor  # grid_shape((R, C), block) float32: the dequantization factor of each block
    block: tuple[int, int]  # (br, bc)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    def t(self) -> Fp8Tensor:
        """The transpose (a view of the same bytes), e.g. W (N, K) -> W^T (K, N) for the forward product."""
        return Fp8Tensor(self.data.t(), self.scale.t(), (self.block[1], self.block[0]))

    def element_scale(self) -> torch.Tensor:
        """Each element's block scale, broadcastable to (R, C)."""
        return element_scale(self.scale, self.shape, self.block)

    def dequantize(self) -> torch.Tensor:
        """(R, C) float32: every FP8 value (exact in float32) times its block's scale, rounded once to float32."""
        return self.data.float() * self.element_scale()


def element_scale(grid: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A per-block grid (ceil(R / br), ceil(C / bc)) spread over the elements of a (R, C) tensor, broadcastable to it
    (a grid dimension of one block is not repeated)."""
    (rows, cols), (br, bc) = shape, block
    if grid.shape[0] > 1:
        grid = grid.repeat_interleave(br, 0)[:rows]
    if grid.shape[1] > 1:
        grid = grid.repeat_interleave(bc, 1)[:, :cols]
    return grid
