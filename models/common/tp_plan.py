"""Tensor-parallel plans of the shared decoder, as data (Megatron-LM layout, Shoeybi et al. 2019, sec. 3).

Attention: q, k and v are column-parallel, so each mp rank holds n_heads/mp query heads and n_kv_heads/mp
key/value heads (k and v split by key/value heads because their output features are n_kv_heads * head_dim,
head-major); with the group size n_heads // n_kv_heads the same on every rank, a rank's query heads are exactly
those its key/value heads serve. Qwen3's per-head q/k norms are replicated, their gradients summed over the
ranks' heads (``QK_NORM_BLOCK_TP_PLAN``). A dense MLP:
gate and up column-parallel (mlp_width/mp hidden units each, multiplied elementwise on the rank that holds both
halves); the row-parallel attention output and down projection all-reduce their partial sums. Keys are relative
to one block (``layers.<i>``); the embedding and the head use the vocabulary plan (models/spec.py); the RMSNorms
stay replicated.

A mixture-of-experts block: attention as above; the router is replicated and the experts are not
tensor-parallel (expert parallelism shards them by expert instead, outside the model). A mixture family's plan
is the dense one: the engine gives each block the entries it has (an MoE block has no ``mlp``), so the blocks it
keeps dense (first-k-dense, mlp_only_layers) split their MLP as a dense model does.

Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2): the RMSNorms run on (B, T/mp, D) sequence shards;
attention and a dense MLP all-gather the sequence before their column-parallel matrices and reduce-scatter it
after their row-parallel one. An MoE block's ``mlp_norm`` runs on shards too, and the layer routes each rank's own
T/mp tokens (compiler/parallelize/expert_parallel.py).

gpt-oss's attention sinks, one logit per query head, split with the heads (``HEADWISE``): each rank's sinks are its
query heads', as its q columns are. q/k/v's biases split with their columns; o's bias is added once, after the
row-parallel sum (DTensor's RowwiseParallel keeps it Replicate). The experts, biases included, are not split.

Multi-head latent attention (models/common/latent_attention.py; Megatron-Core's and torchtitan's DeepSeek-V3 layout):
``q`` (q_b_proj, or q_proj) and ``kv_b`` are column-parallel by heads (their outputs are head-major), ``o``
row-parallel; the down projections ``q_a`` and ``kv_a`` and their norms are replicated. The RoPE key every head
shares leaves the replicated region without a linear layer: ``rope_key`` sums its gradient over the heads' ranks
(``HEAD_SHARED``), as the column-parallel layers sum their inputs' gradients. Under sequence parallelism the
attention's input is the gathered sequence (a Replicate DTensor), which the replicated down projections take as
DTensors of their own (``REPLICATED``).
"""

from models.spec import (
    COLWISE,
    GATHER_SEQUENCE,
    HEAD_NORM,
    HEAD_SHARED,
    HEADWISE,
    REPLICATED,
    ROWWISE,
    ROWWISE_SCATTER,
    SEQUENCE_NORM,
)

ATTENTION_TP_PLAN: dict[str, str] = {"attn.q": COLWISE, "attn.k": COLWISE, "attn.v": COLWISE, "attn.o": ROWWISE}
DENSE_BLOCK_TP_PLAN: dict[str, str] = {**ATTENTION_TP_PLAN, "mlp.gate": COLWISE, "mlp.up": COLWISE,
                                       "mlp.down": ROWWISE}
# Qwen3's q/k norms act within each head, but their weight is every head's: with the heads split over mp its
# gradient is a sum over the ranks' heads (HEAD_NORM: input Shard(heads), weight Replicate).
QK_NORM_BLOCK_TP_PLAN: dict[str, str] = {**DENSE_BLOCK_TP_PLAN, "attn.q_norm": HEAD_NORM, "attn.k_norm": HEAD_NORM}

SINK_BLOCK_TP_PLAN: dict[str, str] = {**ATTENTION_TP_PLAN, "attn.sinks": HEADWISE}

_ATTENTION_SEQUENCE_PARALLEL = {"attn_norm": SEQUENCE_NORM, "attn": GATHER_SEQUENCE, "attn.o": ROWWISE_SCATTER,
                                "mlp_norm": SEQUENCE_NORM}
DENSE_SEQUENCE_PARALLEL_PLAN: dict[str, str] = {**_ATTENTION_SEQUENCE_PARALLEL, "mlp": GATHER_SEQUENCE,
                                                "mlp.down": ROWWISE_SCATTER}

LATENT_BLOCK_TP_PLAN: dict[str, str] = {"attn.q": COLWISE, "attn.kv_b": COLWISE, "attn.rope_key": HEAD_SHARED,
                                        "attn.o": ROWWISE, "mlp.gate": COLWISE, "mlp.up": COLWISE, "mlp.down": ROWWISE}
LATENT_SEQUENCE_PARALLEL_PLAN: dict[str, str] = {**DENSE_SEQUENCE_PARALLEL_PLAN, "attn.q_a": REPLICATED,
                                                 "attn.kv_a": REPLICATED}
