"""``fp8_linear`` on tensor-parallel (DTensor) parameters: the local shards computed in FP8 with every scale taken
over the whole logical tensor, the output handed back as the DTensor torch's own linear would give.

DTensor's ``ColwiseParallel`` / ``RowwiseParallel`` (and the engine's ``ReplicatedLinear``) leave a linear's weight
a DTensor on the 1-D mp mesh and give it a DTensor input; the placements say which tensors are shards
(x and dy (tokens, features), W (out, in), compiler/fp8/README.md "Scales over shards"):

    weight Shard(0), column-parallel: x Replicate; W by rows, dy by features -> MAX over mp for W and dy;
        y Shard(-1); x's gradient is this rank's partial sum (Partial), which the input's DTensor reduces
    weight Shard(1), row-parallel: x Shard(-1), W by columns -> MAX over mp for x and W; y Partial (the
        output style all-reduces or reduce-scatters it; its gradient arrives whole); the bias added after, once
    weight Replicate: nothing sharded; y Replicate

``shards`` adds what the placements cannot say (the engine's token shards under context parallelism). A MAX
turns NaN into inf first: an all-reduce(MAX) may drop a NaN, and the numerics guard must see it on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from compiler.fp8.guard import AmaxGuard
from compiler.fp8.linear import LinearShards, Shards, fp8_linear
from compiler.fp8.quantize import AmaxReduce
from compiler.fp8.recipe import Recipe


def max_over(group: dist.ProcessGroup) -> AmaxReduce:
    """all-reduce(MAX) of a local amax grid over ``group`` (NaN sent as inf: reductions may drop a NaN)."""

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        amax = torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax).contiguous()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    return reduce


def combined(a: LinearShards, b: LinearShards) -> LinearShards:
    return LinearShards(input=a.input + b.input, weight=a.weight + b.weight, grad_output=a.grad_output + b.grad_output)


def fp8_linear_dtensor(x: DTensor, weight: DTensor, bias: torch.Tensor | None, recipe: Recipe, *,
                       shards: LinearShards = LinearShards(), guard: AmaxGuard | None = None) -> DTensor:
    """x (..., K) and W (N, K) DTensors on one 1-D mesh, b (N,) -> (..., N) DTensor (module docstring)."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or not isinstance(x, DTensor):
        raise TypeError(f"an FP8 linear with a DTensor weight takes a DTensor input on a 1-D mesh, got weight placements "
                        f"{weight.placements} and a {type(x).__name__} input")
    (placement,) = weight.placements
    reduce = max_over(mesh.get_group())
    shape = torch.Size([*x.shape[:-1], weight.shape[0]])
    local_bias = bias
    if placement == Shard(0):  # column-parallel
        x_local = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        tp = LinearShards(weight=(Shards(0, reduce),), grad_output=(Shards(1, reduce),))
        out = [Shard(len(shape) - 1)]
    elif placement == Shard(1):  # row-parallel
        x_local = x.redistribute(mesh, [Shard(x.ndim - 1)]).to_local()
        tp = LinearShards(input=(Shards(1, reduce),), weight=(Shards(1, reduce),))
        out, local_bias = [Partial()], None
    elif placement == Replicate():
        x_local, tp, out = x.redistribute(mesh, [Replicate()]).to_local(), LinearShards(), [Replicate()]
    else:
        raise TypeError(f"an FP8 linear cannot run a weight placed {placement}")
    if isinstance(local_bias, DTensor):
        local_bias = local_bias.to_local()
    y = fp8_linear(x_local, weight.to_local(), local_bias, recipe, shards=combined(shards, tp), guard=guard)
    y = DTensor.from_local(y, mesh, out, run_check=False, shape=shape, stride=_contiguous_stride(shape))
    return y + bias if bias is not None and local_bias is None else y


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= n
    return tuple(reversed(out))
