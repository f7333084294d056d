"""Causal attention over a band of keys (a sliding window), with attention sinks, as one opaque operator
(``torch.ops.attention.banded``) written with public torch only.

Queries q (B, H, Lq, hd) stand at key positions ``q_offset`` .. ``q_offset + Lq - 1`` of keys k (B, Hkv, Lk, hd)
and values v (B, Hkv, Lk, hdv) (grouped heads shared as ``enable_gqa``: key/value head h serves query heads
h g .. h g + g - 1). Query i sees keys j with ``i - window < j <= i`` (positions counted from the first key;
``window`` 0: every earlier key): gpt-oss's and Mistral's sliding window, Hugging Face's ``sliding_window``. Where the
keys begin is the caller's: a document's first token, a context-parallel rank's gathered keys, a KV cache.

**Sinks** (gpt-oss, after Xiao et al. 2023's attention sinks): a learned logit per head (``sinks`` (B, H, Lq), each
query's head's) joins each query's softmax denominator and takes no value, p = softmax([scores, sink])[:-1]: with
the log-sum-exp of the scores ``lse``, ``out * sigmoid(lse - sink)``. The sink enters the normaliser once, as one
more column of the query's softmax, ``lse' = logaddexp(lse, sink)``, computed as transformers' eager GptOss attention
computes it (the scores and the sink less their maximum, exponentiated, divided by their sum), which rounds as it
does. The operator returns ``(out, lse')``.

**No T x T tensor**: queries run in chunks of ``chunk``; chunk [c0, c1) meets only the keys some of its queries see,
``visible_keys`` (the one place that computes a query range's key range: the model's core, context parallelism and
the KV cache all call it), so a sliding layer computes T x (window + chunk - 1) scores (chunks of half the window:
about 1.5 T window), never T x T. Within a chunk the keys are walked in blocks of at most ``KEY_BLOCK`` with an online
softmax, as FlashAttention does (Dao et al. 2022, alg. 1): a running max m, sum l and output acc per query, the sink
one more softmax column entered once, as the start (m = sink, l = 1, acc = 0; lse' = m + log l, out = acc / l). So
what a chunk holds at once is (B, H, chunk, min(keys, ``KEY_BLOCK``)) scores, whatever T: a full layer's last chunk
under context parallelism (every rank's queries meet up to all T gathered keys) too. A chunk whose keys fit one block
computes the plain softmax over [scores, sink] of the Sinks paragraph, rounding as it does. No block is ever wholly
masked for its chunk: the blocks tile ``visible_keys``' range, every key of which some query of the chunk sees.
The backward recomputes the scores block by block from (out, lse'), as FlashAttention's does (Dao et al. 2022,
alg. 2): with D_i = dout_i . out_i, ds = p (dp - D + dlse'), dq = ds k / sqrt(hd) (summed over the blocks),
dk = ds^T q / sqrt(hd), dv = p^T dout (per block), and for each query's sink d sink_i = p_sink,i (dlse'_i - D_i)
(p_sink = exp(sink - lse')). Scores and softmax run in fp32 (fp64 for fp64 inputs) whatever the inputs' dtype; outputs
come back in q's dtype (lse' in that compute dtype).

Why an operator: shapes are static (the chunks are Python integers), but as one node it stays opaque to selective
activation checkpointing (its chunks' scores are never cached) and to FlopCounterMode, which counts it by
``BANDED_ATTENTION_FLOPS`` (the products it computes, masked pairs of a chunk included), and runs under
FakeTensorMode (``register_fake``) for the cost model.
"""

from __future__ import annotations

import torch

NAMESPACE = "attention"
DEFAULT_CHUNK = 128  # queries per chunk of full attention
MIN_CHUNK = 16
# Keys per block of a chunk's online softmax: bounds a chunk's scores at chunk x KEY_BLOCK whatever T (4 MiB of fp32
# per score-sized tensor at 8 heads and 128 queries), large enough that a block's products keep the CPU's GEMMs busy
# and that short sequences (up to KEY_BLOCK keys) compute in one block.
KEY_BLOCK = 1024


def default_chunk(window: int | None) -> int:
    """Queries per chunk: ``DEFAULT_CHUNK`` for full attention; half the window on a sliding layer, whose chunk meets
    chunk + window - 1 keys, so it computes about 1.5 window scores per query where window are needed."""
    return DEFAULT_CHUNK if not window else max(MIN_CHUNK, min(DEFAULT_CHUNK, -(-window // 2)))


def visible_keys(first: int, stop: int, *, window: int | None, start: int = 0) -> tuple[int, int]:
    """[lo, hi) of the keys that queries at positions first .. stop - 1 see: causal (hi = stop) and, with a
    ``window``, from the first query's window on, never before ``start`` (a document's first position)."""
    lo = start if not window else max(start, first - window + 1)
    return lo, stop


def _band(first: int, stop: int, lo: int, hi: int, window: int, device: torch.device) -> torch.Tensor:
    """(stop - first, hi - lo) bool: query position i sees key position j (j <= i, and i - window < j)."""
    rows = torch.arange(first, stop, device=device)[:, None]
    cols = torch.arange(lo, hi, device=device)[None, :]
    seen = cols <= rows
    return seen & (cols > rows - window) if window else seen


def _chunks(lq: int, q_offset: int, window: int, chunk: int):
    """(c0, c1, lo, hi) per chunk of queries: their rows and the keys they meet."""
    for c0 in range(0, lq, chunk):
        c1 = min(lq, c0 + chunk)
        yield (c0, c1, *visible_keys(q_offset + c0, q_offset + c1, window=window))


def _key_blocks(lo: int, hi: int):
    """[b0, b1) blocks of at most ``KEY_BLOCK`` keys tiling a chunk's keys [lo, hi), the last one partial."""
    for b0 in range(lo, hi, KEY_BLOCK):
        yield b0, min(hi, b0 + KEY_BLOCK)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, L, d) -> (B, Hkv, g, L, d): query head h is group member h % g of key/value head h // g."""
    return t.unflatten(1, (kv_heads, -1))


@torch.library.custom_op(f"{NAMESPACE}::banded", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor? sinks, int q_offset, int window, int chunk)"
                                " -> (Tensor, Tensor)")
def banded(q, k, v, sinks, q_offset, window, chunk):
    kv_heads, scale = k.shape[1], q.shape[-1] ** -0.5
    qg, dtype = _grouped(q, kv_heads), _compute_dtype(q)  # (B, Hkv, g, Lq, hd)
    out = q.new_empty((*qg.shape[:-1], v.shape[-1]), dtype=dtype)  # (B, Hkv, g, Lq, hdv)
    lse = q.new_empty(qg.shape[:-1], dtype=dtype)  # (B, Hkv, g, Lq)
    sink = None if sinks is None else _grouped(sinks, kv_heads).to(dtype)  # (B, Hkv, g, Lq)
    for c0, c1, lo, hi in _chunks(q.shape[2], q_offset, window, chunk):
        attend = _one_block if hi - lo <= KEY_BLOCK else _key_blocks_online
        out[..., c0:c1, :], lse[..., c0:c1] = attend(qg[..., c0:c1, :], k, v, None if sink is None else sink[..., c0:c1],
                                                     scale=scale, first=q_offset + c0, keys=(lo, hi), window=window)
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)  # (B, H, Lq, hdv), (B, H, Lq)


def _one_block(q_c: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None, *, scale: float,
               first: int, keys: tuple[int, int], window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Hkv, g, C, hdv), lse' (B, Hkv, g, C)) of a chunk of queries whose keys fit one block: the softmax over
    [scores, sink] as transformers' eager attention computes it (module docstring)."""
    lo, hi = keys
    s = _scores(q_c, k[:, :, None, lo:hi], scale, first, lo, window)  # (B, Hkv, g, C, K)
    if sink is not None:  # one more column, dropped after the softmax
        s = torch.cat([s, sink[..., None]], dim=-1)
    top = s.amax(-1, keepdim=True)  # every query sees itself: finite
    p = s.sub_(top).exp_()
    total = p.sum(-1, keepdim=True)
    p = p.div_(total)
    out = (p if sink is None else p[..., :-1]) @ v[:, :, None, lo:hi].to(s.dtype)
    return out, (top + total.log()).squeeze(-1)


def _key_blocks_online(q_c: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None, *,
                       scale: float, first: int, keys: tuple[int, int],
                       window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse') of a chunk of queries over its keys in ``KEY_BLOCK`` blocks, with FlashAttention's online softmax
    (Dao et al. 2022, alg. 1): running max m, sum l and output acc (B, Hkv, g, C[, hdv]), the sink the start."""
    dtype = _compute_dtype(q_c)
    rows = q_c.shape[:-1]  # (B, Hkv, g, C)
    if sink is None:
        m, total = q_c.new_full(rows, float("-inf"), dtype=dtype), q_c.new_zeros(rows, dtype=dtype)
    else:  # the sink's column: exp(sink - m) = 1 with m = sink
        m, total = sink.clone(), q_c.new_ones(rows, dtype=dtype)
    acc = q_c.new_zeros((*rows, v.shape[-1]), dtype=dtype)
    for b0, b1 in _key_blocks(*keys):
        m, total, acc = _online_step(_scores(q_c, k[:, :, None, b0:b1], scale, first, b0, window),
                                     v[:, :, None, b0:b1].to(dtype), m, total, acc)
    return acc / total[..., None], m + total.log()  # every query sees itself: m finite, total >= 1 term


def _online_step(s: torch.Tensor, v: torch.Tensor, m: torch.Tensor, total: torch.Tensor,
                 acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key block (scores s (B, Hkv, g, C, Kb), values v (B, Hkv, 1, Kb, hdv)) into the running (m, total, acc);
    its own function so the block's scores are freed before the next block's are made."""
    m_new = torch.maximum(m, s.amax(-1))
    # a query that has seen no key yet (no sink, its keys all in later blocks) stays at m = -inf: shift by 0 there,
    # so its exp(-inf - 0) are 0, not exp(-inf + inf) = nan
    shift = m_new.masked_fill(m_new == float("-inf"), 0.0)
    rescale = torch.exp(m - shift)  # (B, Hkv, g, C): the earlier blocks' terms under the new max
    e = s.sub_(shift[..., None]).exp_()
    return m_new, total * rescale + e.sum(-1), acc * rescale[..., None] + e @ v


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, first: int, lo: int, window: int) -> torch.Tensor:
    """Scores (in the compute dtype) of a chunk of queries (first position ``first``) against keys from position
    ``lo``, the keys they do not see at -inf; made in place, one score-sized tensor."""
    dtype = _compute_dtype(q)
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)).mul_(scale)
    band = _band(first, first + q.shape[-2], lo, lo + k.shape[-2], window, q.device)
    return s.masked_fill_(~band, float("-inf"))


@banded.register_fake
def _banded_shapes(q, k, v, sinks, q_offset, window, chunk):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=_compute_dtype(q))


@torch.library.custom_op(f"{NAMESPACE}::banded_backward", mutates_args=(),
                         schema="(Tensor dout, Tensor dlse, Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor out, "
                                "Tensor lse, int q_offset, int window, int chunk) -> (Tensor, Tensor, Tensor, Tensor)")
def banded_backward(dout, dlse, q, k, v, sinks, out, lse, q_offset, window, chunk):
    """(dq, dk, dv, dsinks) given the gradients of (out, lse') (module docstring); dsinks is empty without sinks."""
    kv_heads, scale, dtype = k.shape[1], q.shape[-1] ** -0.5, _compute_dtype(q)
    qg, dog = _grouped(q, kv_heads), _grouped(dout, kv_heads).to(dtype)  # (B, Hkv, g, Lq, ...)
    lse_g, dlse_g = _grouped(lse, kv_heads), _grouped(dlse, kv_heads).to(dtype)  # (B, Hkv, g, Lq)
    d = (dog * _grouped(out, kv_heads).to(dtype)).sum(-1) - dlse_g  # (B, Hkv, g, Lq): D - dlse'
    dq = torch.zeros(qg.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    for c0, c1, lo, hi in _chunks(q.shape[2], q_offset, window, chunk):
        q_c, do_c = qg[..., c0:c1, :].to(dtype), dog[..., c0:c1, :]
        lse_c, d_c = lse_g[..., c0:c1, None], d[..., c0:c1, None]
        for b0, b1 in _key_blocks(lo, hi):
            k_b, v_b = k[:, :, None, b0:b1].to(dtype), v[:, :, None, b0:b1].to(dtype)
            dq_b, dk_b, dv_b = _block_backward(q_c, k_b, v_b, do_c, lse_c, d_c, scale=scale, first=q_offset + c0,
                                               lo=b0, window=window)
            dq[..., c0:c1, :] += dq_b
            dk[:, :, b0:b1] += dk_b
            dv[:, :, b0:b1] += dv_b
    if sinks is None:
        dsinks = q.new_empty(0)
    else:
        p_sink = torch.exp(_grouped(sinks, kv_heads).to(dtype) - lse_g)  # (B, Hkv, g, Lq)
        dsinks = (-p_sink * d).flatten(1, 2).to(sinks.dtype)  # (B, H, Lq)
    # Contiguous, whatever the inputs' strides (q, k, v are often transposed views): what the fake kernel says.
    return (dq.flatten(1, 2).to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(),
            dsinks.contiguous())


def _block_backward(q_c: torch.Tensor, k_b: torch.Tensor, v_b: torch.Tensor, do_c: torch.Tensor, lse_c: torch.Tensor,
                    d_c: torch.Tensor, *, scale: float, first: int, lo: int,
                    window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq (B, Hkv, g, C, hd), dk (B, Hkv, Kb, hd), dv (B, Hkv, Kb, hdv)) of one chunk of queries (q_c, dout do_c,
    lse' and D - dlse' (B, Hkv, g, C, 1)) against one key block (k_b, v_b (B, Hkv, 1, Kb, d)), p recomputed."""
    p = _scores(q_c, k_b, scale, first, lo, window).sub_(lse_c).exp_()  # (B, Hkv, g, C, Kb)
    dv = (p.transpose(-1, -2) @ do_c).sum(2)
    ds = (do_c @ v_b.transpose(-1, -2)).sub_(d_c).mul_(p)
    del p  # freed before dq's and dk's products
    return (ds @ k_b) * scale, (ds.transpose(-1, -2) @ q_c).sum(2) * scale, dv


@banded_backward.register_fake
def _backward_shapes(dout, dlse, q, k, v, sinks, out, lse, q_offset, window, chunk):
    # new_empty, not empty_like: empty_like keeps a transposed input's strides, the kernel returns contiguous tensors
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), \
        (q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape))


def _save(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, sinks, ctx.q_offset, ctx.window, ctx.chunk = inputs
    ctx.has_sinks = sinks is not None
    ctx.save_for_backward(q, k, v, sinks, *output)


def _backward(ctx, dout: torch.Tensor, dlse: torch.Tensor | None):
    q, k, v, sinks, out, lse = ctx.saved_tensors
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    dq, dk, dv, dsinks = banded_backward(dout.contiguous(), dlse, q, k, v, sinks, out, lse, ctx.q_offset, ctx.window,
                                         ctx.chunk)
    return dq, dk, dv, dsinks if ctx.has_sinks else None, None, None, None


banded.register_autograd(_backward, setup_context=_save)


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None,
                     q_offset: int = 0, window: int | None = None,
                     chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Lq, hdv), lse' (B, H, Lq)) of q against the keys each query sees (module docstring); ``sinks``
    (B, H, Lq) or None, ``window`` None or 0 for none; ``chunk`` queries per chunk (``default_chunk``)."""
    if q_offset + q.shape[2] > k.shape[2]:
        raise ValueError(f"queries at positions {q_offset}..{q_offset + q.shape[2] - 1} need as many keys, "
                         f"got {k.shape[2]}")
    return torch.ops.attention.banded(q, k, v, sinks, q_offset, window or 0, chunk or default_chunk(window))


def _pairs(q_shape, q_offset: int, window: int, chunk: int) -> int:
    """(query, key) pairs the chunks compute, masked ones of a chunk included, over every batch row and head."""
    batch, heads, lq, _ = q_shape
    return batch * heads * sum((c1 - c0) * (hi - lo) for c0, c1, lo, hi in _chunks(lq, q_offset, window, chunk))


def banded_flops(q_shape, k_shape, v_shape, sinks_shape, q_offset, window, chunk, **kwargs) -> int:
    """QK^T and PV over the pairs the chunks compute: 2 pairs (hd + hdv)."""
    return 2 * _pairs(q_shape, q_offset, window, chunk) * (q_shape[-1] + v_shape[-1])


def banded_backward_flops(dout_shape, dlse_shape, q_shape, k_shape, v_shape, sinks_shape, saved_out_shape,
                          saved_lse_shape, q_offset, window, chunk, **kwargs) -> int:
    """Five products, as torch counts the flash backward: the scores again, dQ and dK (hd each), dP and dV (hdv)."""
    return 2 * _pairs(q_shape, q_offset, window, chunk) * (3 * q_shape[-1] + 2 * v_shape[-1])


# For FlopCounterMode(custom_mapping=...), as models/common/grouped_mm.py's GROUPED_MM_FLOPS.
BANDED_ATTENTION_FLOPS = {torch.ops.attention.banded: banded_flops,
                          torch.ops.attention.banded_backward: banded_backward_flops}
