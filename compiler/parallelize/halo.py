"""Halos for sliding-window attention under context parallelism: a rank's queries of a sliding layer (window W) see
only the W - 1 keys before each of its chunks besides the chunk's own, so when W - 1 <= L (the chunk length, T /
(2·cp)) the rank receives those W - 1 keys and values of the chunk before each of its chunks instead of the whole
sequence: the traffic and the keys held depend on W, not on T (the halo exchange of stencil codes; Mistral's and
gpt-oss's sliding windows, Jiang et al. 2023 sec. 2).

**Who sends what** (load-balanced chunks, compiler/parallelize/context_parallel.py ``chunk_order``: rank c holds
chunks c and 2·cp−1−c): chunk c's halo is the tail of chunk c − 1, which rank c − 1 holds as its first chunk (chunk
0 has none); chunk 2·cp−1−c's halo is the tail of chunk 2·cp−2−c, which rank c + 1 holds as its second chunk, except
on rank cp − 1, whose second chunk (cp) follows its own first (cp − 1). So every rank sends its first chunk's tail up
one rank and its second chunk's tail down one rank, and receives one halo from each neighbour: one
``batch_isend_irecv`` of 2 messages per rank (no rank waits on a ring), the same on gloo and NCCL.

**Backward**: each halo's gradient goes back where its keys came from (down one rank for the first chunk's halo, up
one for the second's) and is added to the tail's gradient there: the mirror of the forward, exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def halo_width(window: int | None, chunk: int) -> int | None:
    """Keys a chunk needs from the chunk before it: W - 1, when the window reaches only into that chunk (W - 1 <=
    ``chunk``); None for full attention or a window longer than a chunk (the all-gather serves those)."""
    if not window or window - 1 > chunk:
        return None
    return window - 1


@dataclass(frozen=True)
class HaloPeers:
    """Where rank ``rank``'s two halos come from: the rank holding the chunk before each of its chunks (None: chunk
    0, no halo; ``rank`` itself: its own first chunk)."""
    first: int | None
    second: int


def halo_peers(rank: int, cp: int) -> HaloPeers:
    """The ranks holding chunk ``rank`` − 1 and chunk 2·cp−2−rank (module docstring)."""
    return HaloPeers(first=rank - 1 if rank > 0 else None, second=rank + 1 if rank < cp - 1 else rank)


def kv_tokens_received(*, window: int | None, seq_len: int, cp: int) -> int:
    """Key (and as many value) tokens the busiest rank of a cp group receives for one attention layer of one
    micro-batch forward (its backward sends as many gradients back): the halos where ``halo_width`` allows, else
    the all-gather's (cp − 1)·T/cp."""
    width = halo_width(window, seq_len // (2 * cp))
    if width is None:
        return (cp - 1) * (seq_len // cp)
    return width * min(2, cp - 1)  # a middle rank hears from both neighbours; with cp 2 each rank from one


def kv_values_received(*, window: int | None, seq_len: int, cp: int, batch: int, kv_heads: int, head_dim: int,
                       value_dim: int | None = None) -> int:
    """Key and value elements the busiest rank receives per attention layer per micro-batch forward
    (``kv_tokens_received`` times each token's Hkv (hd + hd_v))."""
    per_token = kv_heads * (head_dim + (value_dim or head_dim))
    return batch * per_token * kv_tokens_received(window=window, seq_len=seq_len, cp=cp)


@dataclass(frozen=True)
class ChunkKeys:
    """The keys (B, Hkv, n, hd), values (B, Hkv, n, hd_v) and document ids (B, n) or None that one local chunk's
    queries may see, covering global positions [base, base + n)."""
    k: torch.Tensor
    v: torch.Tensor
    documents: torch.Tensor | None
    base: int


def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
              group: dist.ProcessGroup) -> None:
    """Point-to-point sends and receives (peers as ranks of ``group``), all posted at once and awaited."""
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for t, peer in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _swap_tails(first_tail: torch.Tensor, second_tail: torch.Tensor, *, group: dist.ProcessGroup, rank: int,
                cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous tails of this rank's two chunks -> the halos of its two chunks (the first empty on rank 0)."""
    peers = halo_peers(rank, cp)
    first_halo = first_tail.new_empty((0,)) if peers.first is None else torch.empty_like(first_tail)
    second_halo = first_tail if peers.second == rank else torch.empty_like(second_tail)
    sends = [(first_tail, rank + 1)] if rank < cp - 1 else []
    sends += [(second_tail, rank - 1)] if rank > 0 else []
    recvs = [] if peers.first is None else [(first_halo, peers.first)]
    recvs += [] if peers.second == rank else [(second_halo, peers.second)]
    _exchange(sends, recvs, group)
    return first_halo, second_halo


def _return_halo_grads(first_grad: torch.Tensor, second_grad: torch.Tensor, *, group: dist.ProcessGroup, rank: int,
                       cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mirror of ``_swap_tails``: the gradients of this rank's halos -> those of its two tails (what the ranks
    that sent them return)."""
    peers = halo_peers(rank, cp)
    first_tail_grad = torch.zeros_like(second_grad)
    second_tail_grad = torch.zeros_like(second_grad)
    sends = [] if peers.first is None else [(first_grad, peers.first)]
    sends += [] if peers.second == rank else [(second_grad, peers.second)]
    recvs = [(first_tail_grad, rank + 1)] if rank < cp - 1 else []
    recvs += [(second_tail_grad, rank - 1)] if rank > 0 else []
    _exchange(sends, recvs, group)
    if peers.second == rank:  # this rank's second chunk read its own first chunk's tail
        first_tail_grad = first_tail_grad + second_grad
    return first_tail_grad, second_tail_grad


def _pack(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, like: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in like]), like)]


class _ExchangeHalos(torch.autograd.Function):
    """Keys and values (B, Hkv, 2L, hd / hd_v), this rank's two chunks -> each chunk's halo of ``width`` tokens
    (module docstring), packed into one message per neighbour; backward: the halos' gradients sent back and added
    to the tails'."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, rank: int, cp: int, width: int, *tensors: torch.Tensor):
        ctx.group, ctx.rank, ctx.cp, ctx.width = group, rank, cp, width
        ctx.shapes = [t.shape for t in tensors]
        run = tensors[0].shape[2] // 2
        tails = [tuple(t[:, :, stop - width:stop] for t in tensors) for stop in (run, 2 * run)]
        first, second = _swap_tails(_pack(tails[0]), _pack(tails[1]), group=group, rank=rank, cp=cp)
        empty = [t.new_empty((*t.shape[:2], 0, t.shape[3])) for t in tails[0]]  # rank 0's chunk 0 has no halo
        first_halos = _unpack(first, tails[0]) if first.numel() else empty
        return (*first_halos, *_unpack(second, tails[1]))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        n, width = len(ctx.shapes), ctx.width
        first_grads, second_grads = grads[:n], grads[n:]
        first = _pack(first_grads) if ctx.rank > 0 else first_grads[0].new_empty((0,))
        first_tail, second_tail = _return_halo_grads(first, _pack(second_grads), group=ctx.group, rank=ctx.rank,
                                                     cp=ctx.cp)
        out = []
        for shape, g_first, g_second, like in zip(ctx.shapes, _unpack(first_tail, second_grads),
                                                  _unpack(second_tail, second_grads), second_grads):
            full = like.new_zeros(shape)  # (B, Hkv, 2L, hd): only the two tails receive gradient
            run = shape[2] // 2
            full[:, :, run - width:run] = g_first
            full[:, :, 2 * run - width:] = g_second
            out.append(full)
        return None, None, None, None, *out


def halo_keys(k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None, *, mesh: DeviceMesh,
              width: int) -> list[ChunkKeys]:
    """This rank's k (B, Hkv, 2L, hd), v and documents (B, 2L) or None -> for each of its two chunks the keys its
    queries may see: the chunk's ``width``-token halo, then the chunk (module docstring)."""
    cp, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    run = k.shape[2] // 2
    k_first, v_first, k_second, v_second = _ExchangeHalos.apply(group, rank, cp, width, k, v)
    doc_halos = (None, None)
    if documents is not None:  # ids take no gradient; (B, width) each, the first empty on rank 0
        tails = [documents[:, stop - width:stop].contiguous() for stop in (run, 2 * run)]
        first, second = _swap_tails(*tails, group=group, rank=rank, cp=cp)
        doc_halos = (first.view(documents.shape[0], -1), second)
    out = []
    for i, (start, k_halo, v_halo) in enumerate(((rank * run, k_first, v_first),
                                                 ((2 * cp - 1 - rank) * run, k_second, v_second))):
        own = slice(i * run, (i + 1) * run)
        docs = None if documents is None else torch.cat([doc_halos[i], documents[:, own]], dim=1)
        out.append(ChunkKeys(torch.cat([k_halo, k[:, :, own]], dim=2), torch.cat([v_halo, v[:, :, own]], dim=2), docs,
                             base=start - k_halo.shape[2]))
    return out
