"""Per-rank memory of a plan, in tensor bytes (the quantity max_memory_allocated and the engine's
``--profile-memory`` measure).

- Weights, gradients and AdamW state (fp32: 4 + 4 + 8 bytes per parameter), split by mp (TP shards
  the block matrices; embeddings, norms and head are replicated) and sharded by FSDP over dp. Under
  pipelining FSDP keeps the stage's parameters gathered from the first forward to the last backward
  (reshard_after_forward=False) and accumulates unsharded gradients until the step's single
  reduce-scatter, so a dp > 1 rank holds full fp32 parameters and gradients during the step plus
  its 1/dp shards of parameters and AdamW state.
- Activations: per micro-batch and layer, the bytes autograd saves (measured by compiler/cost.py
  under the plan's autocast dtype and TP shard), times the micro-batches the schedule keeps in
  flight on the busiest rank, as the schedule registry states them (compiler/schedules.py: GPipe all m,
  1F1B min(m, p), interleaved 1F1B its warm-up depth), each of 1/v of the rank's layers. With activation
  checkpointing a layer keeps only its fp32 input, plus one layer's full activations while it is
  recomputed.
- Autocast's low-precision weight copies, cached for the step.
- Tensor parallelism (mp > 1) keeps more than the shard's own saved tensors: DTensor's redistributions
  (the all-reduces of Megatron's f / g operators) hold full-size [B, T, d] fp32 buffers. We have not
  traced which; the term is measured: on 4 blocks, d 128, T 64 the TP runs' peak exceeded the rest
  of this model by 2.2 MiB (bf16, B 8), 4.0-5.5 MiB (bf16, B 16) and 6.5 MiB (fp32, B 16), i.e. about
  two such buffers per block and in-flight micro-batch, which is what we add.
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


TP_BUFFERS_PER_BLOCK = 2  # full [B, T, d] fp32 buffers per block and in-flight micro-batch when mp > 1 (measured)


def rank_memory(layers: list[LayerCost], *, schedule: str, p: int, m: int, v: int, dp: int, rank: int,
                activation_checkpointing: bool, micro_batch_size: int, seq_len: int, d_model: int,
                mp: int = 1) -> MemoryEstimate:
    """Memory of pp rank ``rank`` holding ``layers`` (already per mp shard) across its v stages."""
    params = sum(c.params for c in layers)
    if dp > 1:
        weights = params * 4 * (2 + 3 / dp)  # gathered params + unsharded grads + shards of params and AdamW
    else:
        weights = params * 16  # params, grads, AdamW exp_avg and exp_avg_sq
    in_flight = in_flight_stage_microbatches(schedule, p=p, m=m, v=v, rank=rank)
    per_stage_microbatch = sum(c.activation_bytes for c in layers) / v
    if activation_checkpointing:
        block_input = micro_batch_size * seq_len * d_model * 4
        per_stage_microbatch = block_input * len(layers) / v
        recompute = max(c.activation_bytes for c in layers)
    else:
        recompute = 0.0
    if mp > 1 and not activation_checkpointing:
        blocks = sum(1 for c in layers if c.name.startswith("layers."))
        per_stage_microbatch += TP_BUFFERS_PER_BLOCK * blocks / v * micro_batch_size * seq_len * d_model * 4
    return MemoryEstimate(weights, in_flight * per_stage_microbatch + recompute, sum(c.weight_copy_bytes for c in layers))
