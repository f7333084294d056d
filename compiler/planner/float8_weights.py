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


def float8_block_weights(shape: DecoderShape, mp: int = 1, *, kind: str = DENSE) -> Fp8Gathered:
    """One block's Float8 linears' weights on one TP shard (module docstring)."""
    attention = _weights(attention_matrices(shape, mp))
    if mlp_kind(kind) == DENSE:
        mlp = _weights(mlp_matrices(shape, shape.mlp_width, mp))
    elif shape.experts.shared:  # block_params' count: shared x one expert's matrices of the shared SwiGLU
        mlp = _weights(mlp_matrices(shape, shared_width(shape.experts), mp), copies=shape.experts.shared)
    else:
        mlp = Fp8Gathered()
    return Fp8Gathered(attention.params + mlp.params, attention.weights + mlp.weights)


def float8_mtp_weights(shape: DecoderShape, mp: int = 1) -> Fp8Gathered:
    """The MTP depths' Float8 linears' weights on the last stage's rank: each depth's block and its projection
    (replicated over mp, as compiler/planner/shape.py ``mtp_params`` counts it)."""
    blocks = [float8_block_weights(shape, mp, kind=kind) for kind in shape.mtp_kinds()]
    return Fp8Gathered(sum(b.params for b in blocks) + shape.mtp_depth * 2 * shape.d_model * shape.d_model,
                       sum(b.weights for b in blocks) + shape.mtp_depth)
