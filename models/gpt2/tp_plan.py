"""The tensor-parallel plan for GPT-2, as data (Megatron-LM layout, Shoeybi et al. 2019, sec. 3).

Blocks: the column-parallel fused q/k/v projection (its output features grouped per head) and MLP
up-projection split the output features, so each mp rank holds H/mp complete heads and mlp_width/mp
hidden units; the row-parallel attention output and MLP down-projection split the input features and
all-reduce their partial sums. One all-reduce in the forward pass of attention and one of the MLP,
and their mirror images in the backward pass. Keys are relative to one block (``layers.<i>``).

Embedding and LM head (sec. 3, "input embedding" / "output embedding"): both are split over the
vocabulary, so each mp rank holds V/mp rows of the (tied) [V, D] weight. The embedding looks up the
tokens in its rows and all-reduces; the head produces the logits of its V/mp words, and the loss is
computed on those sharded logits (vocabulary-parallel cross-entropy) without gathering [B, T, V].
Layer norms and the position embedding stay replicated.
"""

from models.spec import COLWISE, GATHER_SEQUENCE, ROWWISE, ROWWISE_SCATTER, SEQUENCE_NORM

BLOCK_TP_PLAN: dict[str, str] = {
    "attn.qkv": COLWISE,
    "attn.o": ROWWISE,
    "mlp.up": COLWISE,
    "mlp.down": ROWWISE,
}

# --sequence-parallel (Korthikanti et al. 2022, sec. 4.2.2): the layer norms run on (B, T/mp, D) sequence
# shards; attention and the MLP all-gather the sequence before their column-parallel matrix and
# reduce-scatter it after their row-parallel one (the all-reduce of the plain plan split in two halves).
SEQUENCE_PARALLEL_PLAN: dict[str, str] = {
    "ln1": SEQUENCE_NORM,
    "attn": GATHER_SEQUENCE,
    "attn.o": ROWWISE_SCATTER,
    "ln2": SEQUENCE_NORM,
    "mlp": GATHER_SEQUENCE,
    "mlp.down": ROWWISE_SCATTER,
}
