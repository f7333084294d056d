"""Build this rank's pipeline stages: trace, keep the local stages, then TP -> AC -> FSDP -> stage.

The order is a checklist (as in torchtitan's ``parallelize_*``): tensor parallelism must see real
``nn.Linear`` modules, activation checkpointing wraps the sharded blocks, and FSDP shards last, over
whatever parameters (plain or already TP-sharded DTensors) the stage then holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from compiler.parallelize.activation_checkpointing import apply_ac
from compiler.parallelize.fully_shard import maybe_apply_fsdp
from compiler.parallelize.tensor_parallel import apply_tp, restore_linear_modules
from compiler.trace import trace_pipeline
from models.tp_plan import GPT_BLOCK_TP_PLAN


@dataclass
class LocalStages:
    indices: list[int]  # global stage indices held by this rank, ascending
    modules: list[nn.Module]
    stages: list[PipelineStage]
    num_stages: int

    @property
    def has_first(self) -> bool:
        return 0 in self.indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.indices

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for m in self.modules for n, p in m.named_parameters()]


def build_local_stages(
    model: nn.Module,
    *,
    blocks_per_stage: list[int],
    stage_indices: list[int],
    example_microbatch: torch.Tensor,
    mesh: DeviceMesh,
    device: torch.device,
    activation_checkpointing: bool,
) -> LocalStages:
    """This rank's stages ``stage_indices`` (its schedule's placement, compiler/schedules.py) of the model cut
    into len(blocks_per_stage) stages, each tensor-parallel over mesh["mp"], checkpointed and FSDP-sharded."""
    n_stages = len(blocks_per_stage)
    indices = sorted(stage_indices)
    pipe = trace_pipeline(model, example_microbatch=example_microbatch, blocks_per_stage=blocks_per_stage)
    modules, stages = [], []
    for index in indices:
        module = pipe.get_stage_module(index)
        restore_linear_modules(module, model)
        if mesh["mp"].size() > 1:
            apply_tp(module, mesh["mp"], block_plan=GPT_BLOCK_TP_PLAN)
        if activation_checkpointing:
            apply_ac(module)
        maybe_apply_fsdp(module, mesh["dp"])
        modules.append(module)
        stages.append(pipe.build_stage(index, device, mesh["pp"].get_group()))
    return LocalStages(indices, modules, stages, n_stages)
