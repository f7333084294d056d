"""Context parallelism: each of the ``cp`` ranks of a context-parallel group holds 1/cp of every sequence, and
attention all-gathers keys and values over the group (as torchtitan's and Llama 3's long-context training do;
Dubey et al. 2024 sec. 3.3.2): queries stay local, K and V are gathered (cheap under grouped-query attention:
Hkv heads), and the backward reduce-scatters their gradients. Multi-head latent attention gathers its latent instead
where that is fewer values (compiler/context_gather.py chooses, latent_gather.py gathers): its core then receives
whole-sequence keys and values and gathers nothing.

**Load balance** (Llama 3; torch's head-tail balancer): a causal sequence is cut into 2·cp chunks of L = T/(2·cp)
tokens and rank c keeps chunks c and 2·cp−1−c, so every rank's queries see the same number of keys in total.
``local_chunks`` makes a rank's (B, T/cp, ...) slice of any per-token tensor; the model then runs on T/cp
tokens with their global positions (RoPE, learned positions) and document ids.

**Attention** of a rank's queries against the gathered, reordered keys: each contiguous run of queries of one
document, at global positions [a, b) of a document that starts at s, attends to keys [s, a) without a mask (the
"prefix") and to keys [a, b) causally (the "diagonal"). No mask of any (T, T) shape is built:
- on CUDA one call does both: ``scaled_dot_product_attention`` with a lower-right causal bias over keys [s, b)
  (the flash and memory-efficient kernels take it natively);
- on the CPU, whose flash kernel aligns causality top-left, the two parts run as two flash calls whose outputs
  are merged by their log-sum-exps (Milakov and Gimelshein 2018's online softmax, as ring attention does); the
  backward runs the flash backward of each part with the merged output and log-sum-exp, which gives each part's
  exact gradients (the softmax's normaliser and dO·O are the merged ones).

**Sliding windows and sinks** (gpt-oss; models/common/attention_core.py): a run's queries see only the keys of their
windows, so the range of gathered keys a run of queries meets is computed by ``visible_keys`` (models/common/
banded_attention.py, the one place that computes it, for the model's own core and its KV cache too): [max(s, a - W +
1), b) for a run [a, b) of a document starting at s. Such a run, and any run of a core with sinks, is one call of the
banded operator with the queries at offset a - lo of those keys: the window's band, the causal diagonal and each
query's sink in one softmax, so the sink joins each query's denominator exactly once, never per part. The keys are
all-gathered as for full attention, except on a sliding layer whose window reaches only the chunk before (W - 1 <=
L): there each local chunk receives just the W - 1 keys and values before it, its halo, from the neighbour rank
holding them (halo.py), and its runs attend over [halo | chunk] (``ChunkKeys``: the keys and their first position),
so the traffic and the keys held depend on W, not on T. A document that starts before the halo is seen from the
halo's first key on, which its windows never reach before anyway.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right

from compiler.parallelize.halo import ChunkKeys, halo_keys, halo_width
from compiler.torch_compat import cpu_flash_attention, cpu_flash_attention_backward
from compiler.trace import take_arguments_in_order
from models import CausalAttention, SinkAttention, any_length_kernels, banded_attention, document_runs, visible_keys


def chunk_order(cp: int) -> list[int]:
    """The 2·cp chunks in the order the ranks hold them: rank 0's two, rank 1's two, ..."""
    return [chunk for rank in range(cp) for chunk in (rank, 2 * cp - 1 - rank)]


def local_chunks(x: torch.Tensor, *, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """(B, T, ...) -> this rank's (B, T/cp, ...): chunks ``rank`` and ``2·cp−1−rank`` of 2·cp along ``dim``."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def natural_order(gathered: torch.Tensor, *, cp: int, dim: int) -> torch.Tensor:
    """The ranks' local slices concatenated in rank order (every rank's two chunks) -> the sequence's order."""
    chunks = gathered.chunk(2 * cp, dim=dim)
    held_at = {chunk: i for i, chunk in enumerate(chunk_order(cp))}
    return torch.cat([chunks[held_at[c]] for c in range(2 * cp)], dim=dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather ``x`` over ``group`` along ``dim`` (rank order); backward: reduce-scatter (sum) of the
    gradient, since every rank's queries contribute to the gradient of every rank's keys."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        front = x.movedim(dim, 0).contiguous()
        out = front.new_empty((dist.get_world_size(group) * front.shape[0], *front.shape[1:]))
        dist.all_gather_into_tensor(out, front, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        front = grad.movedim(ctx.dim, 0).contiguous()
        out = front.new_empty((front.shape[0] // dist.get_world_size(ctx.group), *front.shape[1:]))
        dist.reduce_scatter_tensor(out, front, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh, *, dim: int) -> torch.Tensor:
    """Every rank's local slice of ``x`` along ``dim`` -> the whole sequence in its natural order."""
    cp = mesh.size()
    if x.requires_grad:
        gathered = _GatherSequence.apply(x, mesh.get_group(), dim)
    else:
        front = x.movedim(dim, 0).contiguous()
        out = front.new_empty((cp * front.shape[0], *front.shape[1:]))
        dist.all_gather_into_tensor(out, front, group=mesh.get_group())
        gathered = out.movedim(0, dim)
    return natural_order(gathered, cp=cp, dim=dim)


class _PrefixAndDiagonal(torch.autograd.Function):
    """Queries (B, H, Lq, hd) against a prefix of keys without a mask and Lq diagonal keys causally, on the
    CPU's flash kernel, merged by log-sum-exp (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_diag, v_diag):
        out_p, lse_p = cpu_flash_attention(q, k_prefix, v_prefix, is_causal=False)
        out_d, lse_d = cpu_flash_attention(q, k_diag, v_diag, is_causal=True)
        lse = torch.logaddexp(lse_p, lse_d)  # (B, H, Lq) fp32
        out = (torch.exp(lse_p - lse).unsqueeze(-1) * out_p + torch.exp(lse_d - lse).unsqueeze(-1) * out_d).to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_diag, v_diag, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_prefix, v_prefix, k_diag, v_diag, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq_p, dk_p, dv_p = cpu_flash_attention_backward(grad, q, k_prefix, v_prefix, out, lse, is_causal=False)
        dq_d, dk_d, dv_d = cpu_flash_attention_backward(grad, q, k_diag, v_diag, out, lse, is_causal=True)
        return dq_p + dq_d, dk_p, dv_p, dk_d, dv_d


def causal_run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, prefix: int) -> torch.Tensor:
    """Queries q (B, H, Lq, hd) at the last Lq of the keys' positions: k (B, Hkv, prefix + Lq, hd), v (B, Hkv,
    prefix + Lq, hd_v), hd_v <= hd. Query i attends to every prefix key and to diagonal keys j <= i (grouped heads
    shared, as enable_gqa)."""
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if q.device.type == "cpu":
        # The CPU flash kernel wants values as wide as q and k; latent attention's are narrower (DeepSeek-V3: 128 of
        # 192): zero columns pad them, and the output's matching columns (zeros) are dropped.
        width = v.shape[-1]
        v = F.pad(v, (0, q.shape[-1] - width)) if width < q.shape[-1] else v
        out = _PrefixAndDiagonal.apply(q, k[:, :, :prefix], v[:, :, :prefix], k[:, :, prefix:], v[:, :, prefix:])
        return out[..., :width]
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k, v))  # the kernels want equal heads
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]))


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, prefix: int, window: int | None,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """A run of queries at the last Lq of the keys' positions (``causal_run_attention``'s arguments), within a
    ``window`` of keys and with each query's sink logit (B, H, Lq) where the core has them."""
    if window or sinks is not None:
        return banded_attention(q, k, v, sinks=sinks, q_offset=prefix, window=window)[0]
    return causal_run_attention(q, k, v, prefix=prefix)


class ContextParallelAttention(nn.Module):
    """Replaces a model's attention core (models/common/attention_core.py ``CausalAttention``: q, k, v after RoPE,
    (B, heads, T/cp, hd), a ``SinkAttention``'s sinks (B, heads, T/cp), and the tokens' document ids (B, T/cp) or
    None) in a context-parallel stage, with the core's window. ``whole_keys``: k and v come as the whole sequence
    (B, heads, T, hd), expanded from a gathered latent (latent_gather.py), and are used as they are."""

    @staticmethod
    def apply(stage_module: nn.Module, mesh: DeviceMesh, *, whole_keys: AbstractSet[str] = frozenset()) -> int:
        """Every attention core of the stage made context-parallel over ``mesh``; returns how many. ``whole_keys``:
        the cores (by name) whose keys and values arrive whole already (latent_gather.py)."""
        cores = [(name, m) for name, m in stage_module.named_modules() if isinstance(m, CausalAttention)]
        for name, core in cores:
            replacement = ContextParallelAttention(mesh, window=core.window, sinks=isinstance(core, SinkAttention),
                                                   whole_keys=name in whole_keys)
            take_arguments_in_order(replacement, core.traced_argument_order)  # as the core took them (compiler/trace.py)
            stage_module.set_submodule(name, replacement)
        return len(cores)

    def __init__(self, mesh: DeviceMesh, *, window: int | None = None, sinks: bool = False, whole_keys: bool = False):
        super().__init__()
        self.mesh, self.window, self.sinks, self.whole_keys = mesh, window, sinks, whole_keys

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        sinks, rest = (rest[0], rest[1:]) if self.sinks else (None, rest)
        documents = rest[0] if rest else None
        cp, rank = self.mesh.size(), self.mesh.get_local_rank()
        run = q.shape[2] // 2  # L: the two chunks' length
        starts = [rank * run, (2 * cp - 1 - rank) * run]  # each local chunk's first global position
        width = None if self.whole_keys else halo_width(self.window, run)
        if width is not None:  # a sliding layer whose window reaches only the chunk before: halos (halo.py)
            keys = halo_keys(k, v, documents, mesh=self.mesh, width=width)
        else:
            docs_all = None if documents is None else gather_sequence(documents, self.mesh, dim=1)  # (B, T)
            if self.whole_keys:  # expanded from a gathered latent (latent_gather.py): (B, H, T, hd) in sequence order
                if k.shape[2] != 2 * cp * run:
                    raise RuntimeError(f"whole-sequence keys expected: {2 * cp * run} positions, got {k.shape[2]}")
                k_all, v_all = k, v
            else:
                k_all, v_all = gather_sequence(k, self.mesh, dim=2), gather_sequence(v, self.mesh, dim=2)
            every = ChunkKeys(k_all, v_all, docs_all, 0)
            keys = [every, every]  # (B, Hkv, T, hd): every position from 0

        def attend(rows: slice, local: slice, chunk: int, first: int, stop: int, start: int) -> torch.Tensor:
            """Queries ``local`` of ``rows`` (of local chunk ``chunk``), at global positions [first, stop) of a document
            starting at ``start``."""
            lo, hi = visible_keys(first, stop, window=self.window, start=start)
            seen, base = keys[chunk], keys[chunk].base
            return run_attention(q[rows, :, local], seen.k[rows, :, lo - base:hi - base],
                                 seen.v[rows, :, lo - base:hi - base], prefix=first - lo, window=self.window,
                                 sinks=None if sinks is None else sinks[rows, :, local])

        if documents is None:
            whole = slice(None)
            return torch.cat([attend(whole, slice(i * run, (i + 1) * run), i, a, a + run, 0) for i, a in enumerate(starts)],
                             dim=2)
        rows = []
        with any_length_kernels():  # every document run is a new shape (models/common/attention_core.py)
            for b in range(q.shape[0]):
                pieces = []
                for i, a in enumerate(starts):
                    seen = keys[i]
                    # each token's document's first position, clamped to the first key held (the window's reach)
                    first = _document_starts(seen.documents[b]) + seen.base
                    for lo, hi in document_runs(documents[b, i * run:(i + 1) * run]):  # one document's runs
                        pieces.append(attend(slice(b, b + 1), slice(i * run + lo, i * run + hi), i, a + lo, a + hi,
                                             int(first[a + lo - seen.base])))
                rows.append(torch.cat(pieces, dim=2))
        return torch.cat(rows, dim=0)


def _document_starts(documents: torch.Tensor) -> torch.Tensor:
    """(T,) non-decreasing document ids -> each token's document's first position."""
    positions = torch.arange(documents.numel(), device=documents.device)
    is_start = torch.ones_like(documents, dtype=torch.bool)
    is_start[1:] = documents[1:] != documents[:-1]
    return torch.cummax(torch.where(is_start, positions, 0), dim=0).values
