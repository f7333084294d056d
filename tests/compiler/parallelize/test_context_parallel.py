"""Context-parallel attention (compiler/parallelize/context_parallel.py) against dense masked attention on the
whole sequence: outputs and the gradients of q, k and v, with and without documents that cross chunk
boundaries, under grouped-query heads. Model-level parity with one process: tests/launches/test_parity.py."""

from __future__ import annotations

import contextlib
import datetime

import pytest
import torch
import torch.nn.functional as F

from compiler.parallelize.context_parallel import (
    _document_starts,
    _PrefixAndDiagonal,
    causal_run_attention,
    chunk_order,
    local_chunks,
    natural_order,
)
from models import CausalAttention
from tests.launch import spawn_ranks


def test_chunks_are_load_balanced_and_gather_back_in_order():
    assert chunk_order(4) == [0, 7, 1, 6, 2, 5, 3, 4]
    x = torch.arange(2 * 16).view(2, 16)
    slices = [local_chunks(x, rank=r, cp=4) for r in range(4)]
    assert slices[1].tolist()[0] == [2, 3, 12, 13]
    assert torch.equal(natural_order(torch.cat(slices, dim=1), cp=4, dim=1), x)


def test_document_starts():
    assert _document_starts(torch.tensor([0, 0, 1, 1, 1, 4, 4])).tolist() == [0, 0, 2, 2, 2, 5, 5]


def _dense(q, k, v, documents):
    """The reference: a (T, T) block-causal mask (documents (B, T) or None)."""
    T = q.shape[2]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if documents is not None:
        mask = mask & (documents.unsqueeze(-1) == documents.unsqueeze(-2)).unsqueeze(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@contextlib.contextmanager
def cudnn_allowed_in_attention_calls():
    """Yields a list that gets, for each ``scaled_dot_product_attention`` call made inside, whether cuDNN's kernel
    could have run it (on the CPU no call runs on cuDNN, but the backends allowed are visible)."""
    real, seen = F.scaled_dot_product_attention, []

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)
    F.scaled_dot_product_attention = recording
    try:
        yield seen
    finally:
        F.scaled_dot_product_attention = real


def test_documents_attend_causally_within_each_on_kernels_that_take_any_length():
    """One call per document run equals the block-causal mask; no call may go to cuDNN, which builds a graph for
    every new length (a 1B Llama's step 4.4x slower with documents on an H200, models/common/attention_core.py)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    documents = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [3] * 12])
    with cudnn_allowed_in_attention_calls() as cudnn_allowed:
        got = CausalAttention()(q, k, v, documents)
    torch.testing.assert_close(got, _dense(q, k, v, documents), rtol=0, atol=1e-12)
    assert len(cudnn_allowed) == 4 and not any(cudnn_allowed)


@pytest.mark.parametrize("v_dim", [8, 6])  # 6: latent attention's values, narrower than q and k
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_prefix_and_diagonal_merge_equals_one_lower_right_causal_call(dtype, v_dim):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 10, width, generator=gen, dtype=torch.float64) for width in (8, v_dim))
    mask = torch.ones(6, 10, dtype=torch.bool).tril(4)  # query i at position 4 + i
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    got = causal_run_attention(*inputs, prefix=4)
    tol = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), want, **tol)
    upstream = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    want_grads = torch.autograd.grad(F.scaled_dot_product_attention(*ref_inputs, attn_mask=mask, enable_gqa=True),
                                     ref_inputs, upstream)
    got_grads = torch.autograd.grad(got, inputs, upstream.to(dtype))
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), w, **tol)
    assert _PrefixAndDiagonal is not None


def _cp_attention_matches_dense(documents_given: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from compiler.parallelize.context_parallel import ContextParallelAttention

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, cp = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(0)  # the whole sequence, the same on every rank
    B, H, Hkv, T, hd = 2, 4, 2, 8 * cp, 8
    q = torch.randn(B, H, T, hd, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hkv, T, hd, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    # documents crossing chunk boundaries: lengths 3, 9, ... (row 0) and one long document then short ones (row 1)
    documents = None
    if documents_given:
        documents = torch.stack([torch.arange(T) // 9 + (torch.arange(T) >= 3),
                                 (torch.arange(T) >= T - 5).long() * (1 + torch.arange(T) % 2)]).cummax(1).values
    want = _dense(q, k, v, documents)
    upstream = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (q, k, v), upstream)

    mine = [local_chunks(t.detach(), rank=rank, cp=cp, dim=2).requires_grad_() for t in (q, k, v)]
    local_docs = None if documents is None else local_chunks(documents, rank=rank, cp=cp, dim=1)
    with cudnn_allowed_in_attention_calls() as cudnn_allowed:
        got = ContextParallelAttention(mesh)(*mine, local_docs)
    assert documents is None or not any(cudnn_allowed)  # document runs: any length (see the test above)
    torch.testing.assert_close(got, local_chunks(want, rank=rank, cp=cp, dim=2), rtol=0, atol=1e-12)
    got_grads = torch.autograd.grad(got, mine, local_chunks(upstream, rank=rank, cp=cp, dim=2))
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, local_chunks(w, rank=rank, cp=cp, dim=2), rtol=0, atol=1e-12)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_equals_dense_masked_attention(cp):
    for documents in (False, True):
        spawn_ranks(_cp_attention_matches_dense, world_size=cp, args=(documents,), timeout=120)


def _cp_windows_and_sinks_match_dense(window: int) -> None:
    """A sliding window (``window`` keys) with sinks, documents crossing chunk boundaries or not: each rank's queries
    against the gathered keys their windows reach, the sink once per query (fp64, exact)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from compiler.parallelize.context_parallel import ContextParallelAttention
    from tests.models.common.test_banded_attention import dense

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, cp = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(1)
    B, H, Hkv, T, hd = 2, 4, 2, 8 * cp, 8  # chunks of 4 tokens
    q = torch.randn(B, H, T, hd, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hkv, T, hd, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.randn(B, H, T, generator=gen, dtype=torch.float64, requires_grad=True)
    for documents in (None, torch.stack([torch.arange(T) // 9 + (torch.arange(T) >= 3), torch.zeros(T).long()])):
        want, _ = dense(q, k, v, sinks=sinks, window=window, documents=documents)
        upstream = torch.randn(want.shape, generator=gen, dtype=torch.float64)
        want_grads = torch.autograd.grad(want, (q, k, v, sinks), upstream)
        mine = [local_chunks(t.detach(), rank=rank, cp=cp, dim=2).requires_grad_() for t in (q, k, v, sinks)]
        docs = () if documents is None else (local_chunks(documents, rank=rank, cp=cp, dim=1),)
        got = ContextParallelAttention(mesh, window=window, sinks=True)(*mine, *docs)
        torch.testing.assert_close(got, local_chunks(want, rank=rank, cp=cp, dim=2), rtol=0, atol=1e-12)
        got_grads = torch.autograd.grad(got, mine, local_chunks(upstream, rank=rank, cp=cp, dim=2))
        for name, g, w in zip("qkvs", got_grads, want_grads):
            torch.testing.assert_close(g, local_chunks(w, rank=rank, cp=cp, dim=2), rtol=0, atol=1e-12,
                                       msg=lambda m: f"rank {rank}, d{name}: {m}")
    dist.destroy_process_group()


@pytest.mark.slow
# windows reaching into the previous chunk of 4 only (halos: 3, and 5 whose W - 1 is the whole chunk) and further (the
# all-gather: 6), and full attention
@pytest.mark.parametrize(("cp", "window"), [(2, 3), (2, 6), (4, 5), (4, 6), (2, None)])
def test_context_parallel_windows_and_sinks_equal_dense_attention(cp, window):
    spawn_ranks(_cp_windows_and_sinks_match_dense, world_size=cp, args=(window,), timeout=120)
