"""Give a stage built on the meta device real storage, holding only this rank's shards.

The model is built, traced, tensor-parallelised and FSDP-sharded on the meta device, so start-up
memory is this rank's share of the model, not the whole model. Then each parameter gets storage for
its local shard (``to_empty``) and its value: the full tensor ``initial_value(name, shape)`` computes
on the CPU (the same on every rank: name-seeded, or read from an export), cut there to the shard this
rank holds; only the shard goes to the device. One full parameter exists at a time, in host memory, so
the transient cost is the largest parameter, not the model. A source that can give rows of dim 0 alone
(``initial_value.rows(name, shape, start, stop)``: a Hugging Face folder's stacked experts, one tensor per
expert in the files) is asked for just the rows a rank keeps when every cut of the parameter is on dim 0
(expert parallelism's Shard(0), FSDP's dim-0 chunks): a rank holding 1/ep of the experts reads 1/ep of their bytes.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from compiler.parallelize.activation_checkpointing import original_name


def materialize(stage_module: nn.Module, *, device: torch.device,
                initial_value: Callable[[str, tuple[int, ...]], torch.Tensor]) -> nn.Module:
    """Allocate the stage's (sharded) parameters on ``device`` and fill each with its share of
    ``initial_value(model name, full shape)``."""
    stage_module.to_empty(device=device)
    with torch.no_grad():
        for name, param in stage_module.named_parameters():
            # Cut the shard where the full value is computed (CPU), then move only the shard: copy_ converts
            # device and dtype, so a rank's transfer is its share, not the whole tensor (a bf16 Hugging Face
            # folder costs the rank its shard in fp32, never the whole tensor).
            shape = tuple(param.shape)
            rows = dim0_rows(param) if hasattr(initial_value, "rows") else None
            if rows is not None:
                part = initial_value.rows(original_name(name), shape, *rows)
                if part.shape != local_shard(param).shape:  # copy_ would broadcast
                    raise RuntimeError(f"{name}: rows {rows} have shape {tuple(part.shape)}, the shard "
                                       f"{tuple(local_shard(param).shape)}")
                local_shard(param).copy_(part)
                continue
            full = initial_value(original_name(name), shape)
            local_shard(param).copy_(shard_of(full, like=param))
    return stage_module


def dim0_rows(like: torch.Tensor) -> tuple[int, int] | None:
    """The rows [start, stop) of dim 0 that ``like`` keeps on this rank when every mesh dimension that cuts it
    cuts dim 0 (so its shard is a run of whole rows), else None: the same cuts as ``shard_of``, applied to row
    indices."""
    if not isinstance(like, DTensor) or not like.shape:
        return None
    if any(getattr(p, "dim", 0) != 0 for p in like.placements):
        return None
    index = torch.arange(like.shape[0]).view(-1, *([1] * (like.dim() - 1))).expand(like.shape)
    kept = shard_of(index, like=like)
    if kept.shape[0] == 0:
        return 0, 0
    first = kept[(slice(None),) + (0,) * (kept.dim() - 1)]  # the row index of each kept row (a view)
    start, stop = int(first[0]), int(first[-1]) + 1
    return (start, stop) if stop - start == kept.shape[0] else None


def local_shard(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def shard_of(full: torch.Tensor, *, like: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that ``like`` (a DTensor, or a plain tensor holding all of it) keeps on this
    rank, cut the way the parallelisms were applied: innermost mesh dimension first. TP (the last mesh
    dimension) shards the full tensor, then FSDP shards the TP shard with ``torch.chunk`` on dim 0 (its
    ``_StridedShard`` placement). ``distribute_tensor`` reads (dp, mp) placements outermost first, which
    agrees only when every chunk is equal: GPT-2's 50,257-row embedding at --dp 4 --mp 2 gave 6,281 rows
    where FSDP holds 6,280. Nothing is communicated: every rank has ``full``."""
    if not isinstance(like, DTensor):
        return full
    mesh, local = like.device_mesh, full
    coordinate = mesh.get_coordinate()
    for dim in reversed(range(mesh.ndim)):
        tensor_dim = getattr(like.placements[dim], "dim", None)  # Shard and FSDP's _StridedShard have one
        if tensor_dim is not None:
            chunks = torch.chunk(local, mesh.size(dim), dim=tensor_dim)
            i = coordinate[dim]
            local = chunks[i] if i < len(chunks) else local.narrow(tensor_dim, 0, 0)
    if local.shape != like.to_local().shape:
        raise RuntimeError(f"cannot place a shard of shape {tuple(local.shape)} into {tuple(like.to_local().shape)} "
                           f"(placements {like.placements})")
    return local


def local_parameter_count(params: list[torch.Tensor]) -> int:
    """Parameter elements this rank holds: each distinct parameter at its local (shard) size."""
    return sum(local_shard(p).numel() for p in {id(p): p for p in params}.values())
