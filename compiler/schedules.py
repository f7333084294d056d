"""Pipeline schedules: torch.distributed.pipelining's, plus the stop-and-wait baseline users leave.

Bubble fractions (idle time / total time with p ranks, m micro-batches, v stages per rank):
- naive stop-and-wait: only one stage works at a time, so (p - 1) / p;
- GPipe and 1F1B (PipeDream-Flush, Narayanan et al. 2021): (p - 1) / (m + p - 1);
- interleaved 1F1B with v virtual stages per rank (Narayanan et al. 2021, sec. 2.2):
  (p - 1) / (v * m + p - 1), i.e. the bubble shrinks by a factor v;
- zero-bubble (Qi et al. 2024) splits backward into input- and weight-gradient passes and fills the
  bubble with the weight passes; with equal F, B and W times its ideal bubble tends to zero.
"""

from __future__ import annotations

from typing import Callable

from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime


class ScheduleNaive(_PipelineScheduleRuntime):
    """Stop-and-wait: micro-batch i runs forward through every stage and backward through every stage
    before micro-batch i + 1 starts, so exactly one stage computes at any time (no overlap).

    Expressed as a compute-only action list per rank; the runtime inserts the sends and receives.
    """

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 scale_grads: bool = True):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        n_stages = stages[0].num_stages
        pp = stages[0].group_size
        self.pipeline_order = {
            rank: naive_rank_actions(rank, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches)
            for rank in range(pp)
        }
        self._prepare_schedule_with_comms(self.pipeline_order)


def naive_rank_actions(rank: int, *, pp: int, n_stages: int, n_microbatches: int) -> list[_Action | None]:
    local = [s for s in range(n_stages) if s % pp == rank]
    actions: list[_Action | None] = []
    for mb in range(n_microbatches):
        actions += [_Action(s, _ComputationType.FORWARD, mb) for s in local]
        actions += [_Action(s, _ComputationType.FULL_BACKWARD, mb) for s in reversed(local)]
    return actions


_MULTI_STAGE = {
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "naive": ScheduleNaive,
}
_SINGLE_STAGE = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def build_schedule(name: str, stages: list[PipelineStage], *, n_microbatches: int, loss_fn: Callable):
    """The schedule object for this rank's stages (looped placement: stage s lives on pp rank s % pp).

    ``loss_fn`` must already divide each micro-batch's loss by ``n_microbatches`` (see
    runtime/amp.py): the schedule then leaves gradients as they are (scale_grads=False) instead of
    making an extra pass over every gradient to divide them after the last micro-batch.
    """
    if name in _SINGLE_STAGE:
        if len(stages) != 1:
            raise ValueError(f"--schedule {name} runs one stage per rank, got {len(stages)}")
        return _SINGLE_STAGE[name](stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return _MULTI_STAGE[name](stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def local_stage_indices(pp_rank: int, *, pp: int, stages_per_rank: int) -> list[int]:
    """Looped placement (Narayanan et al. 2021): rank r holds stages r, r + p, r + 2p, ..."""
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def bubble_fraction(name: str, *, p: int, m: int, v: int) -> float:
    """Theoretical idle fraction of a pipeline step (see the module docstring)."""
    if p == 1:
        return 0.0
    if name == "naive":
        return (p - 1) / p
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zero-bubble":
        # Qi et al. 2024: with T_F = T_B = T_W the schedule can hide the whole (p - 1) warm-up; report
        # the ideal. Real F/B/W imbalance leaves some bubble, which the study measures.
        return 0.0
    raise ValueError(f"unknown schedule {name}")


def ideal_speedup_over_naive(name: str, *, p: int, m: int, v: int) -> float:
    """Throughput ratio implied by the bubble formulas: (1 - bubble) / (1 - naive bubble)."""
    return (1 - bubble_fraction(name, p=p, m=m, v=v)) / (1 - bubble_fraction("naive", p=p, m=m, v=v))
