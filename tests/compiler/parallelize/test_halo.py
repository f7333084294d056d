"""Halo bookkeeping of sliding-window context parallelism (compiler/parallelize/halo.py): which rank holds the chunk
before each local chunk, when the window allows halos, what a rank receives, and, over real gloo ranks, that each
chunk's keys cover exactly the W - 1 positions before it and their gradients go back where they came from. The
attention on top of them against dense attention: test_context_parallel.py; the model against one process:
tests/launches/test_parity.py."""

from __future__ import annotations

import datetime

import pytest
import torch

from compiler.parallelize.context_parallel import chunk_order, local_chunks
from compiler.parallelize.halo import HaloPeers, halo_peers, halo_width, kv_tokens_received, kv_values_received
from tests.launch import spawn_ranks


def test_halos_only_where_the_window_reaches_just_the_previous_chunk():
    assert halo_width(None, 16) is None  # full attention: all-gathered
    assert halo_width(8, 16) == 7
    assert halo_width(8, 7) == 7  # W - 1 == L: the halo is the whole previous chunk
    assert halo_width(8, 6) is None  # W - 1 > L: the window reaches two chunks back
    assert halo_width(1, 4) == 0  # a window of one key sees only itself


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_each_halo_comes_from_the_rank_holding_the_previous_chunk(cp):
    owner = {chunk: i // 2 for i, chunk in enumerate(chunk_order(cp))}
    for rank in range(cp):
        first, second = rank, 2 * cp - 1 - rank  # the rank's chunks, as local_chunks cuts them
        want = HaloPeers(first=None if first == 0 else owner[first - 1], second=owner[second - 1])
        assert halo_peers(rank, cp) == want
    assert halo_peers(cp - 1, cp).second == cp - 1  # chunk cp follows the same rank's chunk cp - 1


def test_received_values_do_not_grow_with_the_sequence_on_halo_layers():
    # gpt-oss-20b's attention: 8 key/value heads of 64, window 128
    shape = dict(batch=1, kv_heads=8, head_dim=64)
    assert kv_tokens_received(window=128, seq_len=32768, cp=2) == 127  # each rank from its one neighbour
    assert kv_tokens_received(window=128, seq_len=32768, cp=8) == 2 * 127  # middle ranks from both
    assert kv_tokens_received(window=128, seq_len=2 * 65536, cp=8) == 2 * 127
    assert kv_tokens_received(window=None, seq_len=32768, cp=4) == 3 * 8192  # full attention: the all-gather
    assert kv_tokens_received(window=128, seq_len=1024, cp=8) == 7 * 128  # chunks of 64 < 127: the all-gather
    assert kv_values_received(window=128, seq_len=32768, cp=4, **shape) == 2 * 127 * 8 * 128
    assert kv_values_received(window=None, seq_len=64, cp=2, batch=2, kv_heads=1, head_dim=4, value_dim=2) == 2 * 32 * 6


def _halo_keys_cover_the_window(window: int) -> None:
    """Every position's key is its position: each local chunk's keys must be [base, chunk end) with base = chunk
    start - (W - 1) (0 for chunk 0), its document ids those positions' ids; with upstream gradient 1 a key's
    gradient counts the chunks that read it (2 for the W - 1 last keys of every chunk but the last)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from compiler.parallelize import halo

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, cp = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    B, Hkv, L = 2, 2, 4
    T, width = 2 * cp * L, window - 1
    positions = torch.arange(T, dtype=torch.float64)
    k = positions.view(1, 1, T, 1).expand(B, Hkv, T, 3)
    v = -positions.view(1, 1, T, 1).expand(B, Hkv, T, 2)  # narrower values
    documents = (torch.arange(T) // 3).expand(B, T)
    mine = [local_chunks(t, rank=rank, cp=cp, dim=2).clone().requires_grad_() for t in (k, v)]
    called = []
    real_gather, dist.all_gather_into_tensor = dist.all_gather_into_tensor, lambda *a, **kw: called.append(a)
    try:
        keys = halo.halo_keys(*mine, local_chunks(documents, rank=rank, cp=cp, dim=1), mesh=mesh, width=width)
    finally:
        dist.all_gather_into_tensor = real_gather
    assert not called  # no collective whose size grows with T
    for start, seen in zip((rank * L, (2 * cp - 1 - rank) * L), keys):
        base = max(0, start - width)
        assert seen.base == base, (rank, start, seen.base)
        torch.testing.assert_close(seen.k[0, 1, :, 0], positions[base:start + L], rtol=0, atol=0)
        torch.testing.assert_close(seen.v[1, 0, :, 1], -positions[base:start + L], rtol=0, atol=0)
        assert torch.equal(seen.documents[1], documents[1, base:start + L])
    grads = torch.autograd.grad([seen.k.sum() + seen.v.sum() for seen in keys], mine)
    in_tail = (positions % L >= L - width) & (positions < T - L)  # read again by the next chunk's halo
    want = (1 + in_tail.double()).view(1, 1, T, 1)
    for g, t in zip(grads, (k, v)):
        torch.testing.assert_close(g, local_chunks(want.expand_as(t), rank=rank, cp=cp, dim=2), rtol=0, atol=0)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(("cp", "window"), [(2, 3), (3, 5), (4, 4)])  # (3, 5): W - 1 == L
def test_halo_keys_cover_each_chunks_window_and_return_their_gradients(cp, window):
    spawn_ranks(_halo_keys_cover_the_window, world_size=cp, args=(window,), timeout=120)
