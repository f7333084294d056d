"""Per token, the tensors one attention layer saves for its backward on one TP shard, the block's norms excluded:
grouped-query attention in the engine's and Megatron's layouts, multi-head latent attention in the engine's
(activations.py adds them up per block; its docstring gives the layouts). ``a``: the compute dtype's bytes (4 in
fp32), ``mp``: the TP ranks, ``autocast``: the run casts to a lower precision."""

from __future__ import annotations

from compiler.planner.shape import DecoderShape, window_of
from models import default_chunk


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


# Score-sized tensors live at once inside the banded kernel (models/common/banded_attention.py): in its forward the
# previous chunk's scores, exponentials and probabilities (s, e, p: freed only when the loop rebinds them) while the
# next chunk's product and its masked copy are made; in its backward 4 beside the gradients it returns (p, dP, dS
# and the previous chunk's). Counted with torch's memory profiler on the operator alone and inside the engine's step
# (a 128-query chunk of 8 heads over 2,048-8,192 keys: 5.03 and 3.97-4.0 chunks).
BANDED_FORWARD_SCORES = 5.0
BANDED_BACKWARD_SCORES = 4.0


def banded_scores_bytes(shape: DecoderShape, kind: str, *, micro_batch_size: int, mp: int,
                        backward: bool = False) -> float:
    """The banded kernel's transient scores in one attention call of a block of ``kind`` (one TP shard), in its
    forward or ``backward``: it runs where a layer slides or has sinks, in chunks of ``default_chunk`` queries, each
    over the keys its queries see and in fp32 (B, H / mp, chunk, keys). A full layer's last chunk meets all T keys,
    under CP too (the rank holding the sequence's last chunk attends over every key before it): its transient grows
    with T, not T / cp. 0 for SDPA's layers."""
    window = window_of(kind)
    if not (shape.sinks or window):
        return 0.0
    chunk = default_chunk(window)
    keys = shape.seq_len if window is None else min(shape.seq_len, chunk + window - 1)
    live = BANDED_BACKWARD_SCORES if backward else BANDED_FORWARD_SCORES
    return live * micro_batch_size * (shape.heads // mp) * chunk * keys * 4
