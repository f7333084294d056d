"""Per token, the tensors one attention layer saves for its backward on one TP shard, the block's norms excluded:
grouped-query attention in the engine's and Megatron's layouts, multi-head latent attention in the engine's
(activations.py adds them up per block; its docstring gives the layouts). ``a``: the compute dtype's bytes (4 in
fp32), ``mp``: the TP ranks, ``autocast``: the run casts to a lower precision."""

from __future__ import annotations

from compiler.planner.shape import DecoderShape, window_of
from models import KEY_BLOCK, default_chunk


def engine_attention(shape: DecoderShape, *, a: int, mp: int) -> float:
    """Per token: attention's saved tensors in the engine layout (one TP shard), norms excluded."""
    t, hd = mp, shape.head_dim
    heads, kv_heads = shape.heads // t, max(1, shape.kv_heads // t)
    if shape.fused_qkv:
        qkv = (heads + 2 * kv_heads) * hd
        rotated = (heads + kv_heads) * hd if shape.positions == "rope" else 0
        return (qkv + rotated + heads * hd) * a + heads * 4
    # q, k and v with their own head counts (SDPA shares the grouped heads: enable_gqa, no H-wide copies), the
    # output, and a log-sum-exp per query head
    qkv = (heads + 2 * kv_heads + heads) * hd * a + heads * 4
    if shape.qk_norm:  # Qwen3's per-head RMSNorm of q and k: its fp32 input copy, 1/rms and normalised output (a)
        qkv += (4 + a) * (heads + kv_heads) * hd + 4 * (heads + kv_heads)
    return qkv


def engine_latent_attention(shape: DecoderShape, *, a: int, mp: int, autocast: bool) -> float:
    """Per token: multi-head latent attention's saved tensors in the engine layout (one TP shard; the block's norm and
    the copies of its output excluded; models/common/latent_attention.py), as autograd saves them:
    - each latent's RMSNorm (q's r_q, kv's r_kv) its input in fp32 (autocast runs rms_norm in fp32: a copy; in fp32
      kv_a's whole output, the latent a view of it), 1/rms, its normalised output (a) and the next projection's input
      (a: the autocast copy, or in fp32 the norm's output);
    - the rotated q and the concatenated k (H/mp x (nope + rope) each), kv_b's output (H/mp x (nope + v): v is a view
      of it), attention's output (H/mp x v) and its fp32 log-sum-exp."""
    s, t = shape.latent, mp
    heads = max(1, s.n_heads // t)
    rope_in_view = 0 if autocast else s.rope_dim  # fp32: the norm saves kv_a's output itself, its RoPE part too
    q_latent = (4 + 2 * a) * s.q_lora_rank + 4 if s.q_lora_rank else 0
    kv_latent = 4 * (s.kv_lora_rank + rope_in_view) + 4 + 2 * a * s.kv_lora_rank
    return q_latent + kv_latent + heads * (2 * s.qk_dim + s.nope_dim + 2 * s.v_dim) * a + heads * 4


def megatron_attention(shape: DecoderShape, *, a: int, mp: int) -> float:
    return (shape.q_width + 2 * shape.kv_width + shape.q_width) / mp * a + shape.heads / mp * 4


# What the banded kernel (models/common/banded_attention.py) holds at once, per batch row and head, in units of its
# fp32 scores (chunk x keys) and of its key-sized tensors (keys x head_dim), keys = min(keys seen, KEY_BLOCK): a
# chunk whose keys fit one block makes its scores and their copy with the sink's column; one over several blocks
# (its online softmax) a block's scores beside the block's keys expanded over the query heads of a group; its
# backward p and dP beside per-head products of the block's keys (the expanded k and v, dK and dV before their sum
# over a group). Counted with torch's memory profiler on the operator (128-query chunks of 8 heads over 4 KV heads,
# head_dim 16-128: 2.0 / 1.0 + 1.375 / 2.0 + 3.125 within 1%).
BANDED_ONE_BLOCK_FORWARD = (2.0, 0.0)  # (scores, key-sized)
BANDED_KEY_BLOCKS_FORWARD = (1.0, 1.375)
BANDED_BACKWARD = (2.0, 3.125)


def banded_scores_bytes(shape: DecoderShape, kind: str, *, micro_batch_size: int, mp: int,
                        backward: bool = False) -> float:
    """The banded kernel's transient in one attention call of a block of ``kind`` (one TP shard), in its forward or
    ``backward``: it runs where a layer slides or has sinks, in chunks of ``default_chunk`` queries, each over the keys
    its queries see in blocks of at most ``KEY_BLOCK`` (fp32, B x H / mp x (chunk, block)). A full layer's last chunk
    meets all T keys, under CP too, but one block at a time: past ``KEY_BLOCK`` keys the transient no longer grows
    with T. 0 for SDPA's layers."""
    window = window_of(kind)
    if not (shape.sinks or window):
        return 0.0
    chunk = default_chunk(window)
    seen = shape.seq_len if window is None else min(shape.seq_len, chunk + window - 1)
    keys = min(seen, KEY_BLOCK)
    if backward:
        scores, keyed = BANDED_BACKWARD
    else:
        scores, keyed = BANDED_ONE_BLOCK_FORWARD if seen <= KEY_BLOCK else BANDED_KEY_BLOCKS_FORWARD
    return (scores * chunk + keyed * shape.head_dim) * keys * micro_batch_size * (shape.heads // mp) * 4
