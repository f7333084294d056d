"""The pipeline schedules, one row of facts each: the registry every other part reads.

Config validation, stage placement, the memory and time models, the planner, the profiler's report
and the study take what they need from a ``ScheduleSpec``; adding a schedule is one entry.

Bubble fractions (idle time / total time with p ranks, m micro-batches, v stages per rank):
- naive stop-and-wait: only one stage works at a time, so (p - 1) / p;
- GPipe and 1F1B (PipeDream-Flush, Narayanan et al. 2021): (p - 1) / (m + p - 1);
- interleaved 1F1B with v virtual stages per rank (Narayanan et al. 2021, sec. 2.2):
  (p - 1) / (v * m + p - 1), i.e. the bubble shrinks by a factor v (for m >= p; with fewer micro-batches
  each loop through the ranks waits for the ring, see ``_interleaved``);
- zero-bubble (Qi et al. 2024) splits backward into input- and weight-gradient passes and fills the
  bubble with the weight passes; with equal F, B and W times its ideal bubble tends to zero. So do its
  V-shaped variant ZB-V (Qi et al. 2024 sec. 6: (p-1)(F+B-2W) of idle time per rank, 0 when F = B = W)
  and DualPipeV (DeepSeek-V3, 2024, table 2, on half the devices: (p-1)(F&B+B-3W), 0 when F = B = W
  and forward and backward chunks do not overlap);
- looped breadth-first (Lamy-Poirier 2023) runs every micro-batch through one local stage before the
  next, on the looped placement: the same (p - 1) / (v * m + p - 1) as interleaved.

Micro-batches in flight (what activation memory scales with), on pp rank ``rank`` at its peak, in
stage-micro-batches (one micro-batch's activations of one of the rank's v stages):
- GPipe keeps all m (x v); naive one per stage; 1F1B min(m, p - rank) (PipeDream-Flush);
- interleaved 1F1B its warm-up depth (v - 1) * m_round + 2 (p - 1 - rank), plus the one in progress
  (Narayanan et al. 2021 sec. 2.2, as torch schedules it);
- looped BFS all m x v, like GPipe;
- ZB-V and DualPipeV about 1F1B's p micro-batches of a 1/p model slice on every rank, i.e. 2p of their
  half-size stages (Qi et al. 2024 sec. 6: "the same peak memory as 1F1B"), and the V makes it even
  across ranks; DualPipeV holds one more (its forward and backward chunks overlap).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from compiler.naive_schedule import ScheduleNaive, forward_only_pass
from compiler.partition import placement_stages
from compiler.torch_compat import skip_self_p2p_warmup


def _stop_and_wait(p: int, m: int, v: int) -> float:
    return (p - 1) / p


def _fill_drain(p: int, m: int, v: int) -> float:
    return (p - 1) / (m + p - 1)


def _interleaved(p: int, m: int, v: int) -> float:
    # (p - 1) / (v m + p - 1) when m >= p. With fewer micro-batches than ranks a loop through the p ranks
    # takes p stage-times however few micro-batches fill it: rank 0 ends its last chunk after
    # (v - 1) max(m, p) + m of them and the last rank p - 1 later, so of that span v m are busy.
    return 1 - v * m / ((v - 1) * max(m, p) + m + p - 1)


def _ideal_zero(p: int, m: int, v: int) -> float:
    # Qi et al. 2024: with T_F = T_B = T_W the schedule can hide the whole (p - 1) warm-up; report
    # the ideal. Real F/B/W imbalance leaves some bubble, which the study measures.
    return 0.0


def _one_per_stage(p: int, m: int, v: int, rank: int) -> int:
    return v


def _all(p: int, m: int, v: int, rank: int) -> int:
    return m * v


def _one_f_one_b(p: int, m: int, v: int, rank: int) -> int:
    return min(m, p - rank)


def _v_shape(p: int, m: int, v: int, rank: int) -> int:
    return min(2 * m, 2 * p)


def _dual_v(p: int, m: int, v: int, rank: int) -> int:
    return min(2 * m, 2 * p + 1)


def _interleaved_warmup(p: int, m: int, v: int, rank: int) -> int:
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min(v * m, (v - 1) * per_round + 2 * (p - 1 - rank))
    return min(v * m, warmup + 1)


@dataclass(frozen=True)
class ScheduleSpec:
    name: str  # the --schedule value
    torch_class: type
    description: str
    reference: str
    bubble: Callable[[int, int, int], float]  # (p, m, v) -> theoretical idle fraction
    in_flight: Callable[[int, int, int, int], int]  # (p, m, v, rank) -> stage-micro-batches held at the peak
    placement: str = "loop"  # which stages a rank holds: compiler/partition.py's placement_stages
    default_v: int = 1  # virtual stages per rank when pp > 1 and --stages-per-rank is not given
    fixed_v: int | None = None  # the only v the schedule runs (None: any)
    min_microbatches_per_pp: int = 0  # 1: needs m >= p (1F1B's warm-up)
    microbatches_multiple_of_pp: bool = False
    split_backward: bool = False  # backward as input-gradient (I) and weight-gradient (W) passes
    planner_v: tuple[int, ...] = ()  # the v values the planner considers (none: never planned)
    # What the planner's time model charges, when the formula is an ideal it does not expect to reach.
    planned_bubble: Callable[[int, int, int], float] | None = field(default=None)

    @property
    def multi_stage(self) -> bool:
        """Takes a list of this rank's stages (torchtitan asks the class the same way)."""
        return issubclass(self.torch_class, PipelineScheduleMulti)

    @property
    def actions_per_microbatch(self) -> int:
        """Compute actions per stage micro-batch: F and B, or F, I and W."""
        return 3 if self.split_backward else 2

    def stage_indices(self, pp_rank: int, *, pp: int, stages_per_rank: int) -> list[int]:
        """The global stage indices pp rank ``pp_rank`` holds, in the order the schedule takes them."""
        return placement_stages(self.placement, pp_rank, pp=pp, stages_per_rank=stages_per_rank)

    def stage_owner(self, stage: int, *, pp: int, stages_per_rank: int) -> int:
        """The pp rank that holds ``stage``."""
        return next(r for r in range(pp) if stage in self.stage_indices(r, pp=pp, stages_per_rank=stages_per_rank))

    def idle_fraction(self, *, p: int, m: int, v: int) -> float:
        return 0.0 if p == 1 else self.bubble(p, m, v)

    def stage_microbatches_in_flight(self, *, p: int, m: int, v: int, rank: int = 0) -> int:
        return self.in_flight(p, m, v, rank)

    def last_stage_in_flight(self, m: int) -> int:
        """Micro-batches the last stage (the head and the loss) holds at once: all m where every forward runs
        before the backwards (GPipe, looped BFS), else one: its backward follows its forward."""
        return m if self.in_flight is _all else 1


# Registry order is the planner's order of preference between plans it predicts equally fast.
SCHEDULES: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("naive", ScheduleNaive, "one micro-batch at a time through every stage (stop-and-wait)",
                 "the baseline users leave", _stop_and_wait, _one_per_stage),
    ScheduleSpec("1f1b", Schedule1F1B,
                 "PipeDream-Flush: after warm-up, alternate one forward and one backward; at most p micro-batches "
                 "in flight", "Narayanan et al. 2021", _fill_drain, _one_f_one_b, fixed_v=1,
                 min_microbatches_per_pp=1, planner_v=(1,)),
    ScheduleSpec("gpipe", ScheduleGPipe, "all forwards, then all backwards (fill, drain)", "Huang et al. 2019",
                 _fill_drain, _all, fixed_v=1, planner_v=(1,)),
    ScheduleSpec("interleaved-1f1b", ScheduleInterleaved1F1B,
                 "each rank holds v non-adjacent stages (rank r: stages r, r+p, ...) and runs 1F1B over them",
                 "Narayanan et al. 2021, sec. 2.2", _interleaved, _interleaved_warmup, default_v=2,
                 microbatches_multiple_of_pp=True, planner_v=(2, 4)),
    ScheduleSpec("zero-bubble", ScheduleInterleavedZeroBubble,
                 "splits backward into input-gradient (I) and weight-gradient (W) passes and fills the bubble with W",
                 "Qi et al. 2024", _ideal_zero, _interleaved_warmup, default_v=2, microbatches_multiple_of_pp=True,
                 split_backward=True, planner_v=(2,),
                 # Zero-bubble reaches ~0 only when F, B and W take equal time; the planner charges interleaved's.
                 planned_bubble=_interleaved),
    ScheduleSpec("zbv", ScheduleZBVZeroBubble,
                 "zero-bubble on a V placement: rank r holds stages r and 2p-1-r (so rank 0 holds the embedding "
                 "and the head), backward split into I and W passes", "Qi et al. 2024, sec. 6", _ideal_zero,
                 _v_shape, placement="v", default_v=2, fixed_v=2, split_backward=True, planner_v=(2,),
                 planned_bubble=_interleaved),
    ScheduleSpec("dualpipev", ScheduleDualPipeV,
                 "DeepSeek's DualPipe folded onto p ranks (V placement): forward and backward of different "
                 "micro-batches interleaved, backward split into I and W; needs m >= 2p",
                 "DeepSeek-V3 report, 2024", _ideal_zero, _dual_v, placement="v", default_v=2, fixed_v=2,
                 min_microbatches_per_pp=2, split_backward=True, planner_v=(2,), planned_bubble=_interleaved),
    ScheduleSpec("looped-bfs", ScheduleLoopedBFS,
                 "looped placement like interleaved, but every micro-batch passes a local stage before the next "
                 "stage starts (breadth-first)", "Lamy-Poirier 2023", _interleaved, _all, default_v=2,
                 planner_v=(2,)),
)}
DEFAULT_SCHEDULE = "interleaved-1f1b"


def bubble_fraction(name: str, *, p: int, m: int, v: int) -> float:
    """Theoretical idle fraction of a pipeline step (see the module docstring)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name}")
    return SCHEDULES[name].idle_fraction(p=p, m=m, v=v)


def ideal_speedup_over_naive(name: str, *, p: int, m: int, v: int) -> float:
    """Throughput ratio implied by the bubble formulas: (1 - bubble) / (1 - naive bubble)."""
    return (1 - bubble_fraction(name, p=p, m=m, v=v)) / (1 - bubble_fraction("naive", p=p, m=m, v=v))


def zero3_problem(schedule: str, *, reshard_after_forward: bool) -> str | None:
    """Why the engine cannot run ZeRO-3 (``--reshard-after-forward``) under ``schedule``, or None. ZeRO-3
    reduce-scatters and reshards after every micro-batch's backward (compiler/parallelize/data_parallel.py); under a
    split backward FSDP's post-backward runs at the end of the input pass, before the weight pass has computed the
    weights' gradients. One rule for train's check (runtime/config.py) and the planner's search."""
    if not (reshard_after_forward and SCHEDULES[schedule].split_backward):
        return None
    plain = ", ".join(n for n, s in SCHEDULES.items() if not s.split_backward)
    return (f"--reshard-after-forward (ZeRO-3) cannot run with --schedule {schedule}: its weight passes come after "
            f"FSDP has resharded the parameters and reduced their micro-batch's gradients; use --schedule {plain}, or "
            f"FSDP without --reshard-after-forward")


def build_schedule(name: str, stages: list[PipelineStage], *, n_microbatches: int, loss_fn: Callable):
    """The schedule object for this rank's stages.

    ``loss_fn`` must already divide each micro-batch's loss by ``n_microbatches`` (see
    runtime/engine/amp.py): the schedule then leaves gradients as they are (scale_grads=False) instead
    of making an extra pass over every gradient to divide them after the last micro-batch.
    """
    spec = SCHEDULES[name]
    if spec.multi_stage:
        if spec.placement == "v":
            for stage in stages:  # the middle stages p-1 and p share a rank: no warm-up message to itself
                skip_self_p2p_warmup(stage)
        return spec.torch_class(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(stages) != 1:
        raise ValueError(f"--schedule {name} runs one stage per rank, got {len(stages)}")
    return spec.torch_class(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)



def evaluation_pass(name: str, schedule) -> contextlib.AbstractContextManager:
    """Around ``schedule.eval()``: torch's V-shaped schedules keep their backward actions in ``eval()`` and
    fail on them, so on the V placement validation runs a forward-only action list (naive_schedule.py)."""
    spec = SCHEDULES[name]
    return forward_only_pass(schedule, placement=spec.placement) if spec.placement == "v" else contextlib.nullcontext()
