"""The tensor-parallel plan for the GPT, as data (Megatron-LM layout, Shoeybi et al. 2019, sec. 3).

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

COLWISE = "colwise"
ROWWISE = "rowwise"
VOCAB_EMBEDDING = "vocab_embedding"  # rows (vocabulary) sharded, token ids replicated, output all-reduced
VOCAB_HEAD = "vocab_head"  # output features (vocabulary) sharded, logits left sharded for the loss

GPT_BLOCK_TP_PLAN: dict[str, str] = {
    "attn.qkv": COLWISE,
    "attn.o": ROWWISE,
    "mlp.up": COLWISE,
    "mlp.down": ROWWISE,
}

# Keys are relative to the model (a stage keeps the names of the parts it holds).
GPT_VOCAB_TP_PLAN: dict[str, str] = {
    "tok_emb": VOCAB_EMBEDDING,
    "head": VOCAB_HEAD,
}
