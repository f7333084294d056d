"""The stop-and-wait pipeline users leave, as an action list for torch's pipeline runtime.

Micro-batch i runs forward through every stage and backward through every stage before micro-batch
i + 1 starts, so exactly one stage computes at any time (no overlap). Expressed as a compute-only
action list per rank, it runs the very same stages and communication as the overlapped schedules
(the runtime inserts the sends and receives): only the order differs.
"""

from __future__ import annotations

from typing import Callable

from torch.distributed.pipelining import PipelineStage

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


def naive_rank_actions(rank: int, *, pp: int, n_stages: int, n_microbatches: int) -> list[Action | None]:
    local = [s for s in range(n_stages) if s % pp == rank]
    actions: list[Action | None] = []
    for mb in range(n_microbatches):
        actions += [Action(s, ComputationType.FORWARD, mb) for s in local]
        actions += [Action(s, ComputationType.FULL_BACKWARD, mb) for s in reversed(local)]
    return actions
