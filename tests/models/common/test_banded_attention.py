"""The banded attention operator (models/common/banded_attention.py) and the cores built on it (attention_core.py:
sliding windows, sinks, documents) against dense masked attention with the sink as an extra softmax column (fp64):
outputs, the log-sum-exp, every input's gradient; the keys each chunk meets, the FLOPs it is counted at, what it saves
for backward (no T x T tensor), the key blocks of its online softmax (the peak memory of a chunk independent of T),
and its run under FakeTensorMode."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from compiler.torch_compat import FakeTensorMode
from models import BANDED_ATTENTION_FLOPS, CausalAttention, SinkAttention, banded_attention, visible_keys
from models.common import banded_attention as kernel
from runtime.observe.memory import peak_growth_during


def dense(q, k, v, *, sinks=None, q_offset=0, window=None, documents=None):
    """Reference: scores (Lq, Lk) under a causal / window / document mask, the sink a softmax column dropped after.
    Returns (out, lse over scores and sink)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2])[:, None] + q_offset
    j = torch.arange(k.shape[2])[None]
    seen = (j <= i) & ((j > i - window) if window else True)
    if documents is not None:
        seen = seen & (documents[:, None, :, None] == documents[:, None, None, :])
    s = s.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[..., None]], dim=-1)
    p = s.softmax(-1)
    return (p if sinks is None else p[..., :-1]) @ v, s.logsumexp(-1)


def _inputs(lq, lk, *, sinks: bool, seed: int = 0, v_dim: int = 8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, lq, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, lk, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, lk, v_dim, generator=gen, dtype=torch.float64)
    s = torch.randn(2, 4, lq, generator=gen, dtype=torch.float64) if sinks else None
    return [t.requires_grad_() if t is not None else None for t in (q, k, v, s)]


@pytest.mark.parametrize(("lq", "q_offset", "window", "chunk"), [
    (13, 0, None, 4),  # full causal in chunks that do not divide the queries
    (13, 0, 3, 4),  # a window shorter than a chunk
    (13, 0, 9, 4),  # a window longer than a chunk (a chunk's keys reach two chunks back)
    (6, 7, 5, 4),  # queries after 7 earlier keys (a KV cache, a context-parallel run)
    (6, 7, None, 128),  # one chunk
])
@pytest.mark.parametrize("sinks", [False, True])
def test_the_operator_is_dense_masked_attention_with_a_sink_column(lq, q_offset, window, chunk, sinks):
    _assert_dense(lq, q_offset, window, chunk, sinks)


def _assert_dense(lq, q_offset, window, chunk, sinks):
    """The operator's (out, lse') and every input's gradient against ``dense`` in fp64."""
    q, k, v, s = _inputs(lq, lq + q_offset, sinks=sinks, v_dim=6)
    out, lse = banded_attention(q, k, v, sinks=s, q_offset=q_offset, window=window, chunk=chunk)
    want, want_lse = dense(q, k, v, sinks=s, q_offset=q_offset, window=window)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    inputs = [t for t in (q, k, v, s) if t is not None]
    gen = torch.Generator().manual_seed(5)
    d_out, d_lse = torch.randn(out.shape, generator=gen, dtype=torch.float64), torch.randn(lse.shape, generator=gen,
                                                                                             dtype=torch.float64)
    got = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), inputs)
    expected = torch.autograd.grad((want * d_out).sum() + (want_lse * d_lse).sum(), inputs)
    for name, a, b in zip("qkvs", got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize(("lq", "q_offset", "window", "chunk"), [
    (23, 0, None, 8),  # full causal: chunks over 8 .. 23 keys, blocks of 5 with a partial last (23 = 4 x 5 + 3)
    (23, 0, 13, 8),  # a window: a chunk's 20 keys in 4 blocks, whose first is beyond the window of its last queries
    (9, 14, None, 4),  # queries after 14 earlier keys (a KV cache, a context-parallel rank): 15 .. 23 keys
    (9, 14, 7, 4),  # ... and a window (10 keys: blocks of 5 and 5)
    (3, 4, None, 4),  # one chunk of 3 queries over 7 keys: a block and a partial one the first query does not see
])
@pytest.mark.parametrize("sinks", [False, True])
def test_key_blocks_with_an_online_softmax_are_dense_masked_attention(lq, q_offset, window, chunk, sinks, monkeypatch):
    """Grouped heads (4 query heads over 2), blocks of 5 keys so that every chunk but the shortest spans several."""
    monkeypatch.setattr(kernel, "KEY_BLOCK", 5)
    _assert_dense(lq, q_offset, window, chunk, sinks)


@pytest.mark.parametrize("sinks", [False, True])
def test_a_chunk_over_more_keys_than_a_block_at_the_kernels_own_block(sinks):
    # 64 queries after 1,236 keys: chunks of 32 over 1,268 and 1,300 keys, a full block and a partial one each
    assert 1236 + 64 - kernel.KEY_BLOCK < kernel.KEY_BLOCK < 1236
    _assert_dense(64, 1236, None, 32, sinks)


def _peaks(keys: int) -> tuple[int, int]:
    """Peak growth of live bytes in the operator's forward and backward over one chunk of 128 queries (fp32, 8 heads
    over 4) after ``keys`` - 128 others, less its outputs and the gradients it returns (sized by Lq and T)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 128, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 4, keys, 16, generator=gen, requires_grad=True) for _ in range(2))
    sinks = torch.randn(1, 8, 128, generator=gen, requires_grad=True)
    cpu = torch.device("cpu")
    (out, lse), forward = peak_growth_during(lambda: banded_attention(q, k, v, sinks=sinks, q_offset=keys - 128), cpu)
    forward -= out.untyped_storage().nbytes() + lse.untyped_storage().nbytes()
    _, backward = peak_growth_during(lambda: (out.sum() + lse.sum()).backward(), cpu)
    backward -= sum(t.grad.untyped_storage().nbytes() for t in (q, k, v, sinks))
    return forward, backward


def test_a_chunks_peak_memory_does_not_grow_with_the_keys_it_meets():
    """Past one block (4 and 8 blocks of keys) a chunk holds the same transient: FlashAttention's O(chunk x block)."""
    short, long = _peaks(4 * kernel.KEY_BLOCK), _peaks(8 * kernel.KEY_BLOCK)
    assert short == long
    block_scores = 8 * 128 * kernel.KEY_BLOCK * 4  # one fp32 (B, H, chunk, KEY_BLOCK) tensor
    assert block_scores <= short[0] <= 4 * block_scores and block_scores <= short[1] <= 4 * block_scores


def test_a_query_sees_the_keys_of_its_window_from_its_documents_start():
    assert visible_keys(10, 14, window=None) == (0, 14)
    assert visible_keys(10, 14, window=4) == (7, 14)  # query 10 sees 7..10
    assert visible_keys(10, 14, window=4, start=9) == (9, 14)  # not before its document
    assert visible_keys(2, 4, window=8, start=0) == (0, 4)


def test_bf16_inputs_compute_in_fp32_and_come_back_in_bf16():
    q, k, v, s = (t.detach() for t in _inputs(9, 9, sinks=True))
    out, lse = banded_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), sinks=s.float(), window=4, chunk=4)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want, _ = dense(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), sinks=s.float().double(),
                    window=4)
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)


def _flops(lq: int, window: int | None, chunk: int) -> int:
    q, k, v, s = _inputs(lq, lq, sinks=True)
    with FlopCounterMode(display=False, custom_mapping=BANDED_ATTENTION_FLOPS) as counter:
        out, _ = banded_attention(q, k, v, sinks=s, window=window, chunk=chunk)
        out.sum().backward()
    return counter.get_total_flops()


def test_a_sliding_layer_costs_t_times_the_window_and_a_full_one_t_squared():
    # each chunk of 8 queries meets its 8 + 7 keys (the first, 8): every 64 more queries cost the same
    sliding = [_flops(t, window=8, chunk=8) for t in (64, 128, 192)]
    assert sliding[2] - sliding[1] == sliding[1] - sliding[0]
    full = _flops(128, window=None, chunk=8) / _flops(64, window=None, chunk=8)
    assert 3.5 < full < 4.0  # (T^2 + T chunk) / 2 pairs
    # forward 2 pairs (hd + hdv), backward 2 pairs (3 hd + 2 hdv): 2 x 2 x 4 heads x 32 x 2 (8 + 8) + ...
    pairs = 2 * 4 * sum((c1 - c0) * (c1 - max(0, c0 - 7)) for c0, c1 in ((0, 8), (8, 16), (16, 24), (24, 32)))
    assert _flops(32, window=8, chunk=8) == 2 * pairs * 16 + 2 * pairs * 40


def test_backward_keeps_linear_memory_not_the_scores():
    """What autograd saves: q, k, v, the sinks, the output and the log-sum-exp; no (T, K) score chunk."""
    q, k, v, s = _inputs(256, 256, sinks=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        banded_attention(q, k, v, sinks=s, window=16, chunk=32)
    assert max(saved) == q.numel() and sum(saved) <= 6 * q.numel()


def test_it_runs_on_shapes_alone():
    with FakeTensorMode():
        q, k, v = torch.empty(1, 4, 64, 8), torch.empty(1, 2, 64, 8), torch.empty(1, 2, 64, 8)
        out, lse = banded_attention(q, k, v, sinks=torch.empty(1, 4, 64), window=16)
        assert out.shape == (1, 4, 64, 8) and lse.shape == (1, 4, 64)


@pytest.mark.parametrize("window", [None, 3])
def test_the_cores_attend_within_documents_and_windows(window):
    q, k, v, s = (t.detach() for t in _inputs(12, 12, sinks=True))
    documents = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [3] * 12])
    torch.testing.assert_close(SinkAttention(window=window)(q, k, v, s, documents),
                               dense(q, k, v, sinks=s, window=window, documents=documents)[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(CausalAttention(window=window)(q, k, v, documents),
                               dense(q, k, v, window=window, documents=documents)[0], rtol=0, atol=1e-12)
    # a KV cache's new queries after cached keys
    torch.testing.assert_close(SinkAttention(window=window).cached(q[:, :, 7:], k, v, q_offset=7, sinks=s[:, :, 7:]),
                               dense(q, k, v, sinks=s, window=window)[0][:, :, 7:], rtol=0, atol=1e-12)


@pytest.mark.parametrize("sinks", [False, True])
def test_the_fake_kernels_agree_with_the_real_ones_on_transposed_inputs(sinks):
    """torch.library's opcheck (shapes, strides, dtypes of the fake kernels vs the real ones; autograd registration):
    q, k, v arrive as (B, T, H, hd) views transposed to (B, H, T, hd), as the model makes them, and inductor
    (--compile) plans its buffers from the fake kernels' strides."""
    b, t, hd = 2, 12, 8
    q = torch.randn(b, t, 4, hd, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k = torch.randn(b, t, 2, hd, dtype=torch.float64).transpose(1, 2).requires_grad_()
    v = torch.randn(b, t, 2, hd, dtype=torch.float64).transpose(1, 2).requires_grad_()
    s = torch.randn(b, 4, t, dtype=torch.float64, requires_grad=True) if sinks else None
    torch.library.opcheck(torch.ops.attention.banded, (q, k, v, s, 0, 5, 4))
    out, lse = torch.ops.attention.banded(q, k, v, s, 0, 5, 4)
    args = (torch.randn_like(out), torch.zeros_like(lse), q.detach(), k.detach(), v.detach(),
            None if s is None else s.detach(), out.detach(), lse.detach(), 0, 5, 4)
    torch.library.opcheck(torch.ops.attention.banded_backward, args)
