"""The tensor-parallel plan for a GPT block, as data (Megatron-LM layout, Shoeybi et al. 2019, sec. 3).

The column-parallel fused q/k/v projection (its output features grouped per head) and MLP
up-projection split the output features, so each mp rank holds H/mp complete heads and
mlp_width/mp hidden units; the row-parallel attention output and MLP down-projection
split the input features and all-reduce their partial sums. One all-reduce in the forward pass of
attention and one of the MLP, and their mirror images in the backward pass.

Keys are relative to one block (``layers.<i>``). Embeddings, layer norms and the LM head stay
replicated across the mp group.
"""

COLWISE = "colwise"
ROWWISE = "rowwise"

GPT_BLOCK_TP_PLAN: dict[str, str] = {
    "attn.qkv": COLWISE,
    "attn.o": ROWWISE,
    "mlp.up": COLWISE,
    "mlp.down": ROWWISE,
}
