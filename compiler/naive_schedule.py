"""The stop-and-wait pipeline users leave, and a forward-only pass for evaluation, as action lists for
torch's pipeline runtime.

Micro-batch i runs forward through every stage and backward through every stage before micro-batch
i + 1 starts, so exactly one stage computes at any time (no overlap). Expressed as a compute-only
action list per rank, it runs the very same stages and communication as the overlapped schedules
(the runtime inserts the sends and receives): only the order differs.

``forward_only_pass`` evaluates through any placement: each micro-batch goes forward through the stages
in order. torch's V-shaped schedules (ZB-V, DualPipeV) cannot ``eval()``: their action lists keep the
backward actions, which fail on a stage run without backward (torch 2.13: "can't steal_bwd_input").
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from torch.distributed.pipelining import PipelineStage

from compiler.partition import placement_stages
from compiler.torch_compat import Action, ComputationType, PipelineScheduleRuntime, set_pipeline_order


class ScheduleNaive(PipelineScheduleRuntime):
    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 scale_grads: bool = True):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        n_stages = stages[0].num_stages
        pp = stages[0].group_size
        set_pipeline_order(self, {
            rank: naive_rank_actions(rank, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches)
            for rank in range(pp)
        })


@contextlib.contextmanager
def forward_only_pass(schedule: PipelineScheduleRuntime, *, placement: str) -> Iterator[None]:
    """Within the block, ``schedule`` runs forward actions only: each micro-batch through the stages in order
    on ``placement`` ("loop" or "v"). The same schedule object (its stages' buffers, its switch between
    training and evaluation) runs them; only its action list is swapped, and restored after."""
    saved = schedule.pipeline_order_with_comms
    pp, v = schedule.pp_group_size, len(schedule._stages)
    order = forward_only_actions(pp=pp, stages_per_rank=v, n_microbatches=schedule._n_microbatches,
                                 placement=placement)
    # Set with its communication written out, not through the runtime's lowering, which checks that every
    # stage runs a backward for every micro-batch. The stage -> rank map is the training schedule's.
    schedule.pipeline_order_with_comms = order
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = saved


def forward_only_actions(*, pp: int, stages_per_rank: int, n_microbatches: int, placement: str) -> dict[int, list[Action]]:
    """Per pp rank: for each micro-batch, each of its stages in order, receiving the input from the previous
    stage's rank and sending the output to the next stage's (neighbours on one rank pass it locally)."""
    held = {rank: sorted(placement_stages(placement, rank, pp=pp, stages_per_rank=stages_per_rank))
            for rank in range(pp)}
    owner = {stage: rank for rank, stages in held.items() for stage in stages}
    last = pp * stages_per_rank - 1
    order = {}
    for rank, stages in held.items():
        actions = []
        for mb in range(n_microbatches):
            for s in stages:
                if s > 0 and owner[s - 1] != rank:
                    actions.append(Action(s, ComputationType.RECV_F, mb))
                actions.append(Action(s, ComputationType.FORWARD, mb))
                if s < last and owner[s + 1] != rank:
                    actions.append(Action(s, ComputationType.SEND_F, mb))
        order[rank] = actions
    return order


def naive_rank_actions(rank: int, *, pp: int, n_stages: int, n_microbatches: int) -> list[Action | None]:
    local = [s for s in range(n_stages) if s % pp == rank]
    actions: list[Action | None] = []
    for mb in range(n_microbatches):
        actions += [Action(s, ComputationType.FORWARD, mb) for s in local]
        actions += [Action(s, ComputationType.FULL_BACKWARD, mb) for s in reversed(local)]
    return actions
