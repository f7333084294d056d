"""The tensor-parallel plan for Llama 3, as data (Megatron-LM layout, Shoeybi et al. 2019, sec. 3).

Blocks: q, k and v are column-parallel, so each mp rank holds n_heads/mp query heads and n_kv_heads/mp
key/value heads (k and v split by key/value heads because their output features are n_kv_heads * head_dim,
head-major); with the group size n_heads // n_kv_heads the same on every rank, a rank's query heads are
exactly those its key/value heads serve. SwiGLU's gate and up are column-parallel (mlp_width/mp hidden
units each, multiplied elementwise on the rank that holds both halves), and the row-parallel attention output
and down projection all-reduce their partial sums. Keys are relative to one block (``layers.<i>``).
The embedding and the head use the default vocabulary plan (models/spec.py VOCAB_TP_PLAN); the RMSNorms
stay replicated.
"""

from models.spec import COLWISE, GATHER_SEQUENCE, ROWWISE, ROWWISE_SCATTER, SEQUENCE_NORM

BLOCK_TP_PLAN: dict[str, str] = {
    "attn.q": COLWISE,
    "attn.k": COLWISE,
    "attn.v": COLWISE,
    "attn.o": ROWWISE,
    "mlp.gate": COLWISE,
    "mlp.up": COLWISE,
    "mlp.down": ROWWISE,
}

# --sequence-parallel (Korthikanti et al. 2022, sec. 4.2.2): the RMSNorms run on (B, T/mp, D) sequence
# shards; attention and the MLP all-gather the sequence before their column-parallel matrices and
# reduce-scatter it after their row-parallel one.
SEQUENCE_PARALLEL_PLAN: dict[str, str] = {
    "attn_norm": SEQUENCE_NORM,
    "attn": GATHER_SEQUENCE,
    "attn.o": ROWWISE_SCATTER,
    "mlp_norm": SEQUENCE_NORM,
    "mlp": GATHER_SEQUENCE,
    "mlp.down": ROWWISE_SCATTER,
}
