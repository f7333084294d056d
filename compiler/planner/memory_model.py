"""Per-rank memory of a plan, in tensor bytes (the quantity max_memory_allocated and the engine's
``--profile-memory`` measure).

- Weights, gradients and AdamW state (fp32: 4 + 4 + 8 bytes per parameter), split by mp (TP shards
  the block matrices, the embedding and the head over the vocabulary; norms and the position
  embedding are replicated), by DP mode (``weight_memory``):
  - no DP or replicate: the whole 16 bytes; replicate adds its gradient buckets' flat copies (4 bytes),
    all in flight at the end of the last backward.
  - FSDP / HSDP over ``shard`` ranks: 16 / shard bytes of shards. Under pipelining FSDP keeps the
    stage's parameters gathered (in the autocast dtype, FSDP's param_dtype) from the first forward to
    the last backward and accumulates unsharded fp32 gradients until the step's single reduce-scatter.
  - ZeRO-3 (reshard after forward): the shards, plus the gathered parameters and unsharded gradient of
    the unit in use and of the one prefetched.
  A tied embedding counts once on a rank that holds both ends (the caller passes its parameters once).
- Activations: per micro-batch and layer, the bytes autograd saves (measured by compiler/cost.py
  under the plan's autocast dtype and TP shard), times the micro-batches the schedule keeps in
  flight on the busiest rank, as the schedule registry states them (compiler/schedules.py: GPipe all m,
  1F1B min(m, p), interleaved 1F1B its warm-up depth), each of 1/v of the rank's layers. With full activation
  checkpointing a layer keeps only its fp32 input, plus one layer's full activations while it is
  recomputed; with selective checkpointing a block keeps its input and its matrix products' and
  attention's outputs (compiler/cost.py ``selective_activation_bytes``), the other layers all they save,
  plus what one block's recomputation allocates (``selective_recompute_bytes``: its saved tensors less the
  kept outputs among them, which come from the cache).
- The loss's backward: the gradient of the logits (in their dtype) and two fp32 chunks of rows, on the rank
  holding the head (compiler/cost.py ``transient_bytes``), once: backward passes run one at a time.
- Autocast's low-precision weight copies, cached for the step, where parameters are fp32 (no FSDP);
  FSDP gathers them in the autocast dtype, so there are none.
- Tensor parallelism (mp > 1) keeps more than the shard's own saved tensors: DTensor's redistributions
  (the all-reduces of Megatron's f / g operators) hold full-size [B, T, d] fp32 buffers. We have not
  traced which; the term is measured: on 4 blocks, d 128, T 64 the TP runs' peak exceeded the rest
  of this model by 2.2 MiB (bf16, B 8), 4.0-5.5 MiB (bf16, B 16) and 6.5 MiB (fp32, B 16), about two such
  buffers per block and in-flight micro-batch, while the loss ran through DTensor's ``loss_parallel``. With
  the chunked vocabulary-parallel loss (compiler/parallelize/cross_entropy.py) the same runs exceed it by
  0.1 MiB (bf16, B 8), 0.0 (bf16, B 16), 1.6 (fp32, B 16) and 3.0 (fp32, B 16, SP): part of the excess was
  the loss's; we add one buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler.cost import LayerCost
from compiler.schedules import SCHEDULES


@dataclass(frozen=True)
class MemoryEstimate:
    weights_and_optimizer: float
    activations: float
    weight_copies: float

    @property
    def total(self) -> float:
        return self.weights_and_optimizer + self.activations + self.weight_copies


def in_flight_stage_microbatches(schedule: str, *, p: int, m: int, v: int, rank: int = 0) -> int:
    """Stage-micro-batches whose activations a pp rank holds at its peak (compiler/schedules.py)."""
    return SCHEDULES[schedule].stage_microbatches_in_flight(p=p, m=m, v=v, rank=rank)


NORMS_PER_BLOCK = 2  # pre-norm blocks (GPT-2, Llama): one norm before attention, one before the MLP
TP_BUFFERS_PER_BLOCK = 1  # full [B, T, d] fp32 buffers per block and in-flight micro-batch when mp > 1 (measured)


@dataclass(frozen=True)
class DataParallelLayout:
    dp: int = 1
    shard: int = 1  # ranks a parameter is sharded over: dp (FSDP), 1 (replicate), or between (HSDP)
    zero3: bool = False  # parameters resharded after every forward and backward
    gather_bytes: int = 4  # bytes of a gathered parameter (FSDP's param_dtype: the autocast dtype)

    @property
    def fsdp(self) -> bool:
        return self.dp > 1 and self.shard > 1


def weight_memory(params: int, largest_unit: int, layout: DataParallelLayout) -> float:
    """Bytes of parameters, gradients and AdamW state of ``params`` elements (see the module docstring);
    ``largest_unit``: parameters of the largest FSDP unit (a block)."""
    if not layout.fsdp:
        return params * (20 if layout.dp > 1 else 16)
    shards = params * 16 / layout.shard
    if layout.zero3:
        return shards + 2 * largest_unit * (layout.gather_bytes + 4)
    return shards + params * (layout.gather_bytes + 4)


@dataclass(frozen=True)
class HeldLayers:
    """What a rank's layers add up to, all the memory model needs of them (per mp shard)."""
    params: int
    largest_params: int  # the largest FSDP unit's parameters (a block, or the embedding / head)
    activation_bytes: float  # summed over the layers, one micro-batch
    largest_activation_bytes: float  # the layer recomputed at once under activation checkpointing
    weight_copy_bytes: float
    layers: int
    blocks: int
    transient_bytes: float = 0.0  # the largest layer's backward transient (the loss's, on the head's rank)
    selective_activation_bytes: float = 0.0  # summed over the layers under selective checkpointing, one micro-batch
    largest_selective_recompute_bytes: float = 0.0  # the block recomputed at once under selective checkpointing

    @staticmethod
    def of(layers: list[LayerCost]) -> "HeldLayers":
        return HeldLayers(sum(c.params for c in layers), max(c.params for c in layers),
                          sum(c.activation_bytes for c in layers), max(c.activation_bytes for c in layers),
                          sum(c.weight_copy_bytes for c in layers), len(layers),
                          sum(1 for c in layers if c.name.startswith("layers.")),
                          max(c.transient_bytes for c in layers),
                          sum(c.selective_activation_bytes for c in layers),
                          max(c.selective_recompute_bytes for c in layers))


def rank_memory(layers: list[LayerCost] | HeldLayers, *, schedule: str, p: int, m: int, v: int,
                layout: DataParallelLayout, rank: int, activation_checkpointing: bool, micro_batch_size: int,
                seq_len: int, d_model: int, mp: int = 1, input_shards: int = 1, sequence_parallel: bool = False,
                activation_itemsize: int = 4, selective_checkpointing: bool = False) -> MemoryEstimate:
    """Memory of pp rank ``rank`` holding ``layers`` (already per mp shard) across its v stages.
    ``input_shards``: ranks a block's input is split over (mp under sequence parallelism).
    ``sequence_parallel`` (the engine's, without AC): each block's two norm inputs, the (B, T, D) activations
    the norms save in ``activation_itemsize`` bytes, are kept as T/mp sequence shards (compiler/parallelize/
    sequence_parallel.py); the gathered inputs of the column-parallel matrices stay whole, as DTensor saves them.
    ``selective_checkpointing`` (with ``activation_checkpointing``): blocks keep what selective checkpointing
    keeps instead of their input alone."""
    held = layers if isinstance(layers, HeldLayers) else HeldLayers.of(layers)
    weights = weight_memory(held.params, held.largest_params, layout)
    in_flight = in_flight_stage_microbatches(schedule, p=p, m=m, v=v, rank=rank)
    per_stage_microbatch = held.activation_bytes / v
    block_input = micro_batch_size * seq_len * d_model * 4  # fp32, whole sequence
    if activation_checkpointing and selective_checkpointing:
        sharded_inputs = held.blocks * block_input * (1 - 1 / input_shards)
        per_stage_microbatch = (held.selective_activation_bytes - sharded_inputs) / v
        recompute = held.largest_selective_recompute_bytes
    elif activation_checkpointing:
        per_stage_microbatch = block_input / input_shards * held.layers / v
        recompute = held.largest_activation_bytes
    else:
        recompute = 0.0
    if mp > 1 and not activation_checkpointing:
        per_stage_microbatch += TP_BUFFERS_PER_BLOCK * held.blocks / v * micro_batch_size * seq_len * d_model * 4
        if sequence_parallel:
            norm_inputs = NORMS_PER_BLOCK * micro_batch_size * seq_len * d_model * activation_itemsize
            per_stage_microbatch -= held.blocks / v * norm_inputs * (1 - 1 / mp)
    copies = 0 if layout.fsdp else held.weight_copy_bytes
    # One backward at a time: the largest transient (the loss's gradient of the logits) comes on top once.
    return MemoryEstimate(weights, in_flight * per_stage_microbatch + recompute + held.transient_bytes, copies)
