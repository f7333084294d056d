"""Per-rank memory of a plan, in tensor bytes (what ``max_memory_allocated`` and the engine's
``--profile-memory`` measure).

- Weights, gradients and AdamW state (fp32: 4 + 4 + 8 bytes per parameter) of the rank's layers (per TP
  shard, experts per EP rank), by how data parallelism holds them (``weight_memory``); under LoRA the frozen base
  is weights alone (4 bytes, 2 in bf16), the adapters all 16, and autocast caches no copy of a frozen weight
  (torch caches casts of leaves that require gradients only):
  - no DP or replicate: the whole 16 bytes; replicate adds its gradient buckets' flat copies (4 bytes),
    all in flight at the end of the last backward.
  - FSDP / HSDP over ``shard`` ranks: 12 / shard bytes of shards through the backward (the weight and AdamW's
    moments: the sharded fp32 gradient is written by the reduce-scatter after the last backward and freed by
    ``zero_grad(set_to_none=True)``). FSDP keeps the stage's parameters gathered (in the autocast dtype, FSDP's
    param_dtype) from the first forward to the last backward and, over several micro-batches, accumulates
    unsharded fp32 gradients until the step's single reduce-scatter (one micro-batch: each unit's gradient is
    reduce-scattered in its backward, two units at once). ZeRO-3 counts 16 / shard.
  - ZeRO-3 (reshard after forward): the shards, plus the gathered parameters and unsharded gradient of the
    unit in use and of the one prefetched.
  - ``--fp8-all-gather`` (``Fp8Gathered``): the Float8 linears' weights are gathered as e4m3 bytes, 1 byte a
    parameter and one fp32 scale a weight (compiler/fp8/fsdp_all_gather.py ``GatheredFp8Weight``); the routed
    experts, embedding, head, norms and routers are gathered in the precision.
  Context parallelism shards like data parallelism (FSDP over dp x cp: cp ranks hold the same parameters).
  Experts are held by ep ranks each and replicated over the rest of dp x cp x mp: their FSDP shards span
  that expert-data-parallel group. A tied embedding counts once on a rank that holds both ends.
- Activations: per micro-batch and layer the bytes autograd saves (compiler/planner/activations.py), times
  the stage-micro-batches the schedule keeps in flight on the rank (compiler/schedules.py: GPipe all m,
  1F1B min(m, p - rank), interleaved 1F1B its warm-up depth), each of 1/v of the rank's layers (the head's
  only on the last stage, which holds one micro-batch, or all m under GPipe and looped BFS); with full
  activation checkpointing a block keeps its input, plus one block's whole activations while it is
  recomputed; the largest transient of a layer once (the loss's fp32 gradients of the logits, K/V gathered
  by context parallelism, the expert dispatch's buffers, a dense block's backward gradients less what the
  head's backward freed before it: compiler/planner/activations.py ``mlp_backward_bytes``): backward passes
  run one at a time, so the peak is in one phase.
- Autocast's low-precision weight copies, cached for the step, where parameters are fp32 (no FSDP).
- FSDP (not ZeRO-3) gathers every unit at the step's start (``unshard_memory``): the peak when little else is held,
  a mostly frozen model's (LoRA).
- FSDP (not ZeRO-3) reduce-scatters after the last backward (``reduce_memory``): the pipeline runtime runs every
  backward without gradient sync and then each unit's post-backward in turn (torch.distributed.pipelining
  stage.py ``backward_maybe_with_nosync``, ``perform_reduce_grad``), so the first unit's reduce-scatter runs with
  every gradient and every other unit's gathered weights still held, activations freed. The peak where activations
  are small, more often under ``--fp8-all-gather``, which shrinks the backward's gathered weights by half but this
  phase's by less (one unit's are freed already, and gloo's copy of the reduce-scatter input is as large as
  before).
- On a CPU, tensor parallelism keeps two more full [B, T, d] fp32 buffers per block and in-flight
  micro-batch than the saved tensors (DTensor's redistributions; measured here on 4 blocks, d 128, T 64: the
  TP runs' peak exceeded the rest of this model by 2.2-6.5 MiB). Not measured on a GPU, where it is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler.schedules import SCHEDULES


@dataclass(frozen=True)
class MemoryEstimate:
    weights_and_optimizer: float
    activations: float
    weight_copies: float
    unshard_excess: float = 0.0  # how far FSDP's gathering at the step's start exceeds the rest (``unshard_memory``)
    reduce_excess: float = 0.0  # how far the reduce-scatters after the last backward exceed it (``reduce_memory``)

    @property
    def total(self) -> float:
        steady = self.weights_and_optimizer + self.activations + self.weight_copies
        return steady + max(self.unshard_excess, self.reduce_excess)


def in_flight_stage_microbatches(schedule: str, *, p: int, m: int, v: int, rank: int = 0) -> int:
    """Stage-micro-batches whose activations a pp rank holds at its peak (compiler/schedules.py)."""
    return SCHEDULES[schedule].stage_microbatches_in_flight(p=p, m=m, v=v, rank=rank)


@dataclass(frozen=True)
class Fp8Gathered:
    """Of some parameters, those FSDP gathers as e4m3 bytes (``--fp8-all-gather``: the Float8 linears' weights)."""
    params: float = 0.0
    weights: int = 0  # how many weight tensors: one fp32 scale each rides with the gathered bytes

    def gathered_bytes(self, params: float, gather_bytes: int) -> float:
        """Bytes of ``params`` parameters gathered: these of them at 1 byte and their scales, the rest at
        ``gather_bytes`` (the precision's)."""
        return (params - self.params) * gather_bytes + self.params + 4 * self.weights


NO_FP8_GATHER = Fp8Gathered()


@dataclass(frozen=True)
class DataParallelLayout:
    dp: int = 1  # ranks holding the same parameters (dp x cp for a dense parameter)
    shard: int = 1  # ranks a parameter is sharded over: dp (FSDP), 1 (replicate), or between (HSDP)
    zero3: bool = False  # parameters resharded after every forward and backward
    gather_bytes: int = 4  # bytes of a gathered parameter (FSDP's param_dtype: the autocast dtype)
    # gloo's reduce_scatter_tensor all-reduces a clone of its input (measured: a unit-sized allocation under
    # reduce_scatter_single, freed after gloo:all_reduce); NCCL's reduces in place
    reduce_scatter_copies_input: bool = False

    @property
    def fsdp(self) -> bool:
        return self.dp > 1 and self.shard > 1


def weight_memory(params: float, largest_unit: float, layout: DataParallelLayout, *, accumulate: bool = True,
                  frozen: float = 0.0, frozen_bytes: int = 4, fp8: Fp8Gathered = NO_FP8_GATHER,
                  fp8_unit: Fp8Gathered = NO_FP8_GATHER) -> float:
    """Bytes of parameters, gradients and AdamW state of ``params`` elements (module docstring);
    ``largest_unit``: parameters of the largest FSDP unit (a block); ``accumulate``: several micro-batches.
    ``frozen`` of the ``params`` (LoRA's base) are weights alone, ``frozen_bytes`` each: no gradient, no AdamW state
    (gathered like the others under FSDP). ``fp8`` / ``fp8_unit``: of ``params`` / ``largest_unit``, those gathered
    in FP8."""
    trained = params - frozen
    if not layout.fsdp:
        return trained * (20 if layout.dp > 1 else 16) + frozen * frozen_bytes
    trained_share = trained / params if params else 0.0  # of a unit's gradients
    if layout.zero3:
        shards = (trained * 16 + frozen * frozen_bytes) / layout.shard
        return shards + 2 * (fp8_unit.gathered_bytes(largest_unit, layout.gather_bytes) + largest_unit * 4 * trained_share)
    shards = (trained * 12 + frozen * frozen_bytes) / layout.shard  # no sharded gradient in the backward
    gradients = trained * 4 if accumulate else 2 * largest_unit * 4 * trained_share
    return shards + fp8.gathered_bytes(params, layout.gather_bytes) + gradients


def unshard_memory(params: float, largest_unit: float, layout: DataParallelLayout, *, frozen: float = 0.0,
                   frozen_bytes: int = 4, fp8: Fp8Gathered = NO_FP8_GATHER,
                   fp8_unit: Fp8Gathered = NO_FP8_GATHER) -> float:
    """Bytes while FSDP gathers a rank's stages at the step's start (the pipeline runtime's UNSHARD action issues
    every unit's all-gather at once; FSDP2 then copies each unit's output into its parameters): the shards (weights
    and AdamW state, no gradient yet), every unit's all-gather input (its shard in the gather dtype) and output (the
    unit gathered), and the largest unit's parameters being copied out. Below the steady phase's memory in full
    training, it is the peak of a mostly frozen model (LoRA; on 2 CPU ranks, dp 2, Llama 3.2 1B blocks, fp32, the
    peaks this model gives were within 6% of those measured: compiler/README.md)."""
    shards = ((params - frozen) * 12 + frozen * frozen_bytes) / layout.shard
    gathered = fp8.gathered_bytes(params, layout.gather_bytes)  # under --fp8-all-gather its input is e4m3 too
    return shards + gathered * (1 + 1 / layout.shard) + fp8_unit.gathered_bytes(largest_unit, layout.gather_bytes)


def reduce_memory(weights: float, largest_unit: float, layout: DataParallelLayout, *, trained_share: float = 1.0,
                  fp8_unit: Fp8Gathered = NO_FP8_GATHER) -> float:
    """Bytes while FSDP (not ZeRO-3) reduce-scatters the largest unit's gradient after the last backward (module
    docstring), given ``weights`` (``weight_memory``'s bytes of the backward: shards, every unit gathered, the
    gradients). That unit's fp32 gradient has moved into the flat reduce-scatter input (same bytes) and its gathered
    weights are freed (resharded); its sharded gradient (1 / shard of it) is new, and so, on gloo, is the input's
    clone. Measured (CPU, 2 ranks, bf16, 4 blocks of d 512, m 2, --fp8-all-gather; the allocations live at the
    peak, grouped by their allocating call): 3 blocks' accumulated gradients (36.1 MiB), one block's reduce-scatter
    input and output (18.3), gloo's clone (12.6) and 3 blocks' gathered weights (9.0) over the step's start's
    73.0: 149.0 MiB, 149.0 here. A later unit's reduce-scatter can overlap its predecessor's, by gloo's timing:
    other runs of the same step peaked at 148.5, 152.0 and 157.5 MiB."""
    gradient = largest_unit * 4 * trained_share
    new = gradient * (1 / layout.shard + (1 if layout.reduce_scatter_copies_input else 0))
    return weights - fp8_unit.gathered_bytes(largest_unit, layout.gather_bytes) + new


@dataclass(frozen=True)
class RankLoad:
    """What one pp rank holds, all the memory model needs of it (per TP shard and EP rank)."""
    dense_params: float  # parameters sharded over the dense data-parallel group
    expert_params: float  # parameters sharded over the expert data-parallel group
    largest_unit: float  # the largest FSDP unit's parameters (a block, or the embedding / head)
    saved_bytes: float  # activations one micro-batch leaves across the rank's layers
    recompute_bytes: float  # one block's whole activations while recomputed (full AC), else 0
    transient_bytes: float  # the largest transient of one of its layers
    weight_copy_bytes: float  # autocast's copies of its weights (no FSDP)
    blocks: int
    tp_buffer_bytes: float = 0.0  # device-specific extra bytes per block and in-flight micro-batch (CPU TP)
    head_saved_bytes: float = 0.0  # of saved_bytes, the head's: only the last stage holds them
    frozen_dense: float = 0.0  # of dense_params, those not trained (LoRA's base): weights alone
    frozen_experts: float = 0.0  # of expert_params, likewise
    frozen_bytes: int = 4  # bytes of a frozen weight (LoRA's base in fp32, or bf16)
    fp8_gathered: Fp8Gathered = NO_FP8_GATHER  # of dense_params, those gathered in FP8 (--fp8-all-gather)
    fp8_gathered_unit: Fp8Gathered = NO_FP8_GATHER  # of largest_unit, likewise


def rank_memory(load: RankLoad, *, schedule: str, p: int, m: int, v: int, rank: int, dense: DataParallelLayout,
                experts: DataParallelLayout) -> MemoryEstimate:
    """Memory of pp rank ``rank`` across its v stages (module docstring)."""
    weights = weight_memory(load.dense_params, load.largest_unit, dense, accumulate=m > 1, frozen=load.frozen_dense,
                            frozen_bytes=load.frozen_bytes, fp8=load.fp8_gathered, fp8_unit=load.fp8_gathered_unit)
    if load.expert_params:
        weights += weight_memory(load.expert_params, load.largest_unit, experts, accumulate=m > 1,
                                 frozen=load.frozen_experts, frozen_bytes=load.frozen_bytes)
    in_flight = in_flight_stage_microbatches(schedule, p=p, m=m, v=v, rank=rank)
    head = load.head_saved_bytes
    per_stage_microbatch = (load.saved_bytes - head + load.blocks * load.tp_buffer_bytes) / v
    activations = (in_flight * per_stage_microbatch + SCHEDULES[schedule].last_stage_in_flight(m) * head
                   + load.recompute_bytes + load.transient_bytes)
    copies = 0.0 if dense.fsdp else load.weight_copy_bytes
    unshard = 0.0
    if dense.fsdp and not dense.zero3:  # ZeRO-3 gathers a unit at its use (module docstring)
        fp8 = {"fp8": load.fp8_gathered, "fp8_unit": load.fp8_gathered_unit}
        groups = [(load.dense_params, load.frozen_dense, dense, fp8), (load.expert_params, load.frozen_experts, experts, {})]
        unshard = sum((unshard_memory(params, load.largest_unit, layout, frozen=frozen, frozen_bytes=load.frozen_bytes,
                                      **gathered)
                       if layout.fsdp else weight_memory(params, load.largest_unit, layout, frozen=frozen,
                                                         frozen_bytes=load.frozen_bytes, **gathered))
                      for params, frozen, layout, gathered in groups if params)
    steady = weights + activations + copies
    reduce = 0.0
    if dense.fsdp and not dense.zero3:
        share = (load.dense_params - load.frozen_dense) / load.dense_params if load.dense_params else 0.0
        reduce = reduce_memory(weights, load.largest_unit, dense, trained_share=share, fp8_unit=load.fp8_gathered_unit)
    return MemoryEstimate(weights, activations, copies, max(0.0, unshard - steady), max(0.0, reduce - steady))
