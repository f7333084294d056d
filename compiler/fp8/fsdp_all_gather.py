"""FSDP2 all-gathers a ``Float8Linear``'s weight in FP8 (``--fp8-all-gather``, tensorwise only): half of bf16's bytes.

FSDP2's extension hooks (torch.distributed.fsdp "FSDP2 ... extensions"; torchao float8/fsdp_utils.py
``WeightWithDynamicFloat8CastTensor`` is the model read, not copied) let the sharded parameter's local tensor say
what is all-gathered:

    Fp8AllGatherWeight (the fp32 master shard, (N / dp, K))
        fsdp_pre_all_gather: quantize the shard with the WHOLE weight's tensorwise scale -> e4m3 bytes (N / dp, K)
        FSDP all-gathers the bytes (uint8-sized), the scale rides along as metadata (every rank has the same)
    fsdp_post_all_gather -> GatheredFp8Weight (e4m3 (N, K) + its 0-d scale, reporting the compute dtype)
        the FP8 linear uses these bytes and scale directly (linear.py ``quantize_operand``): no second quantization.

A tensorwise scale is amax / 448 over the whole weight, so the shards' amaxes are reduced (MAX) over the FSDP
shard group and, for a tensor-parallel weight (a DTensor sharded over mp), over mp too: the bytes are then exactly
those one process quantizes from the whole weight. The weight does not change within a step, so the reduced amax
is cached: ``precompute_whole_amaxes`` fills every cache before a step's first forward in one all-reduce per
group (torchao's ``precompute_float8_dynamic_scale_for_fsdp``), ZeRO-3's re-gathers and a pipeline's
micro-batches reuse it, and ``forget_whole_amax`` drops it once the optimizer has changed the weight. A gather
that finds no cached amax (a validation's forwards after an update) reduces its own then and keeps it. Every rank
of a group gathers, precomputes and forgets alike, so they agree on when a reduction runs. (Version counters
cannot tell: an in-place write through the DTensor parameter, as the optimizer's, does not bump its local
tensor's counter.)
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from compiler.fp8.guard import AmaxGuard
from compiler.fp8.quantize import AmaxReduce
from compiler.fp8.recipe import Recipe
from compiler.fp8.tensor import WEIGHT_FORWARD, Fp8Tensor
from compiler.torch_compat import DISABLED_TORCH_FUNCTION, dtensor_local, make_wrapper_subclass, tree_leaves, tree_map_only

aten = torch.ops.aten
# Ops FSDP (sharding, padding, to_empty, copy-in) runs on the shard that must keep the wrapper (torchao's list)
_KEEP_WRAPPER = {aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default, aten.slice.Tensor,
                 aten.copy_.default, aten.view.default, aten.as_strided.default, aten._to_copy.default,
                 aten._pin_memory.default, aten.split.Tensor, aten.clone.default, aten.alias.default}


class Fp8AllGatherWeight(torch.Tensor):
    """A high-precision weight shard (a wrapper around ``_tensor``) that FSDP all-gathers in FP8 (module docstring).
    ``tp_group``: the ranks holding the weight's other tensor-parallel shards (None: not TP-sharded)."""

    _tensor: torch.Tensor
    recipe: Recipe
    guard: AmaxGuard | None
    tp_group: dist.ProcessGroup | None

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, recipe: Recipe, *, guard: AmaxGuard | None = None,
                tp_group: dist.ProcessGroup | None = None):
        return make_wrapper_subclass(cls, tensor, dtype=tensor.dtype, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, recipe: Recipe, *, guard: AmaxGuard | None = None,
                 tp_group: dist.ProcessGroup | None = None):
        self._tensor, self.recipe, self.guard, self.tp_group = tensor, recipe, guard, tp_group
        self._whole_amax: torch.Tensor | None = None  # (1, 1) float32, the whole weight's amax, while it holds

    @property
    def master(self) -> torch.Tensor:
        """The high-precision shard this wraps (what checkpoints and the optimizer's state are made of)."""
        return self._tensor

    def __repr__(self) -> str:
        return f"Fp8AllGatherWeight({self._tensor!r}, recipe={self.recipe.name})"

    def _wrap(self, t: torch.Tensor) -> Fp8AllGatherWeight:
        return Fp8AllGatherWeight(t, self.recipe, guard=self.guard, tp_group=self.tp_group)

    __torch_function__ = DISABLED_TORCH_FUNCTION

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, Fp8AllGatherWeight))
        if func is aten.detach.default:
            return first._wrap(first._tensor.detach())
        args, kwargs = tree_map_only(Fp8AllGatherWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPER:
            return out
        return tree_map_only(torch.Tensor, first._wrap, out)

    # --- the whole weight's amax -------------------------------------------------------------------------

    def local_amax(self) -> torch.Tensor:
        """(1, 1) float32: max |w| over this shard (0 for an empty one; NaN if it holds one)."""
        if self._tensor.numel() == 0:
            return torch.zeros(1, 1, dtype=torch.float32, device=self._tensor.device)
        return self._tensor.abs().amax().float().reshape(1, 1)

    def set_whole_amax(self, amax: torch.Tensor) -> None:
        self._whole_amax = amax.reshape(1, 1)

    def forget_whole_amax(self) -> None:
        """The weight is about to change (or has): the next gather reduces its amax again unless precomputed."""
        self._whole_amax = None

    def whole_amax(self, fsdp_group: dist.ProcessGroup) -> torch.Tensor:
        """The cached amax, else the local one reduced over FSDP and TP now (and cached)."""
        if self._whole_amax is None:
            amax = self.local_amax()
            for group in (fsdp_group, self.tp_group):
                amax = amax if group is None else max_over_group(group)(amax)
            self.set_whole_amax(amax)
        return self._whole_amax

    # --- FSDP2's extension hooks ----------------------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The shard's FP8 bytes (padded to FSDP's padded shard rows) and, as metadata, the whole weight's scale.
        The master shard is quantized as it is (fp32): one rounding, as one process quantizes its weight."""
        whole = self.whole_amax(mesh.get_group())
        q = self.recipe.quantize(self._tensor, WEIGHT_FORWARD, amax_reduce=lambda _local: whole, guard=self.guard)
        padded_rows = -(-outer_size[0] // mesh.size())
        data = q.data if q.data.shape[0] == padded_rows else F.pad(q.data.view(torch.uint8),
                                                                    (0, 0, 0, padded_rows - q.data.shape[0])).view(q.data.dtype)
        return (data,), q.scale

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: torch.Tensor,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None):
        (data,) = all_gather_outputs
        if out is not None:  # a re-gather into the same unsharded parameter: the bytes landed, the scale is new
            local = dtensor_local(out) if isinstance(out, DTensor) else out
            local.scale = metadata
            return None
        return GatheredFp8Weight(data, metadata, dtype=param_dtype), (data,)


class GatheredFp8Weight(torch.Tensor):
    """The all-gathered weight: e4m3 ``data`` (N, K) and its float32 tensorwise ``scale`` (1, 1), standing for
    ``data * scale`` in ``dtype`` (the dtype FSDP computes in). ``fp8()`` is what the linear multiplies by; any
    other op sees the dequantized weight."""

    data_fp8: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype):
        return make_wrapper_subclass(cls, data, dtype=dtype, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype):
        self.data_fp8, self.scale = data, scale

    def __repr__(self) -> str:
        return f"GatheredFp8Weight({tuple(self.shape)}, {self.data_fp8.dtype}, scale={self.scale.item():.3e})"

    def fp8(self) -> Fp8Tensor:
        """The weight's tensorwise quantization: one block spanning it."""
        return Fp8Tensor(self.data_fp8, self.scale, tuple(self.data_fp8.shape))

    __torch_function__ = DISABLED_TORCH_FUNCTION

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, GatheredFp8Weight))
        if func in (aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default):
            # FSDP's as_strided to the unpadded size, nn.Parameter's detach, to_local's view_as: same bytes, reshaped
            data = func(first.data_fp8, *args[1:], **kwargs)
            return GatheredFp8Weight(data, first.scale, dtype=first.dtype)
        args, kwargs = tree_map_only(GatheredFp8Weight, lambda t: t.fp8().dequantize().to(t.dtype), (args, kwargs))
        return func(*args, **kwargs)


def max_over_group(group: dist.ProcessGroup) -> AmaxReduce:
    """all-reduce(MAX) of an amax over ``group`` (NaN sent as inf, as tensor_parallel.max_over)."""

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        amax = torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax).contiguous()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    return reduce


def precompute_whole_amaxes(shards: Iterable[tuple[Fp8AllGatherWeight, tuple[dist.ProcessGroup, ...]]]) -> None:
    """Reduce every listed shard's amax over its groups (every mesh dimension that shards the weight: FSDP's, and
    tensor parallelism's) and cache it (module docstring), one all-reduce of a stacked vector per set of groups.
    Every rank of a group must list the same weights in the same order (the ranks of an FSDP or TP group hold the
    same stages)."""
    by_groups: dict[tuple[int, ...], tuple[tuple[dist.ProcessGroup, ...], list[Fp8AllGatherWeight]]] = {}
    for shard, groups in shards:
        by_groups.setdefault(tuple(id(g) for g in groups), (groups, []))[1].append(shard)
    for groups, members in by_groups.values():
        amax = torch.cat([m.local_amax().reshape(1) for m in members])  # (n,)
        for group in groups:
            amax = max_over_group(group)(amax)
        for m, a in zip(members, amax):
            m.set_whole_amax(a)
