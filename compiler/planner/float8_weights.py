"""The weights ``--fp8`` runs through Float8 linears, on one rank (one TP shard): what ``--fp8-all-gather`` has FSDP
gather as e4m3 bytes, one fp32 scale each (compiler/fp8/fsdp_all_gather.py).

compiler/parallelize/float8.py swaps every ``nn.Linear`` but the LM head, the token embedding and the routers
(compiler/fp8/modules.py ``keep_high_precision``): a block's attention projections, its dense MLP or its shared
experts' SwiGLU (one, of the shared experts' summed width: models/common/moe.py), and each MTP depth's 2d -> d
projection (models/common/mtp.py ``eh_proj``) besides its block's. The routed experts (grouped products), norms,
embedding and head are gathered in the precision, and so are biases (only a linear's ``weight`` is wrapped).
"""

from __future__ import annotations

from compiler.planner.memory_model import Fp8Gathered
from compiler.planner.shape import DENSE, DecoderShape, attention_matrices, mlp_kind, mlp_matrices, shared_width


def _weights(mats: dict[str, tuple[int, int]], copies: int = 1) -> Fp8Gathered:
    return Fp8Gathered(copies * sum(i * o for i, o in mats.values()), len(mats))


def _mlp_matrices(shape: DecoderShape, mp: int, kind: str) -> tuple[dict[str, tuple[int, int]], int]:
    """The block's Float8 MLP linears and how many copies (the shared experts' SwiGLU counts ``shared`` times, as
    block_params does); none for routed experts alone."""
    if mlp_kind(kind) == DENSE:
        return mlp_matrices(shape, shape.mlp_width, mp), 1
    if shape.experts.shared:
        return mlp_matrices(shape, shared_width(shape.experts), mp), shape.experts.shared
    return {}, 1


def float8_block_weights(shape: DecoderShape, mp: int = 1, *, kind: str = DENSE) -> Fp8Gathered:
    """One block's Float8 linears' weights on one TP shard (module docstring)."""
    attention = _weights(attention_matrices(shape, mp))
    mlp = _weights(*_mlp_matrices(shape, mp, kind))
    return Fp8Gathered(attention.params + mlp.params, attention.weights + mlp.weights)


def largest_float8_weight(shape: DecoderShape, mp: int = 1, *, kind: str = DENSE) -> int:
    """Elements of the block's largest Float8 linear weight on one TP shard (what a CPU's FP8 product of it holds in
    fp32: compiler/planner/devices.py ``fp8_product_bytes_per_weight``)."""
    mats = [*attention_matrices(shape, mp).values(), *_mlp_matrices(shape, mp, kind)[0].values()]
    return max((i * o for i, o in mats), default=0)


def float8_mtp_weights(shape: DecoderShape, mp: int = 1) -> Fp8Gathered:
    """The MTP depths' Float8 linears' weights on the last stage's rank: each depth's block and its projection
    (replicated over mp, as compiler/planner/shape.py ``mtp_params`` counts it)."""
    blocks = [float8_block_weights(shape, mp, kind=kind) for kind in shape.mtp_kinds()]
    return Fp8Gathered(sum(b.params for b in blocks) + shape.mtp_depth * 2 * shape.d_model * shape.d_model,
                       sum(b.weights for b in blocks) + shape.mtp_depth)
