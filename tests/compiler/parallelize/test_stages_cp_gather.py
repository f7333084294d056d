"""The stage build follows the plan's --cp-gather (compiler/parallelize/stages.py): with latent attention under
context parallelism it gathers the latent (a ``GatheredLatent`` before tracing, its core told the keys are whole) for
``latent`` and ``auto`` (the debug model's latent is the fewer values: 24 against 56), and the keys and values for
``kv``. One rank of a pretended cp 2 world; both paths' numbers: tests/compiler/parallelize/test_latent_gather.py."""

from __future__ import annotations

import functools

import pytest
import torch

from compiler.parallelize.context_parallel import ContextParallelAttention
from compiler.parallelize.data_parallel import DataParallelOptions
from compiler.parallelize.latent_gather import GatheredLatent
from compiler.parallelize.stages import StageMeshes, build_local_stages
from models import named_config, spec_of
from tests.fake_world import fake_world


def _built_stage(cp_gather: str) -> torch.nn.Module:
    cfg = named_config("deepseek-v3-debug")
    with fake_world(rank=0, world_size=2):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("pp", "mp", "cp"))
        stages = build_local_stages(
            cfg, blocks_per_stage=[cfg.n_layers], stage_indices=[0], micro_batch_size=1,
            meshes=StageMeshes(pp=mesh["pp"], mp=mesh["mp"], fsdp=None), device=torch.device("cpu"),
            activation_checkpointing="none", data_parallel=DataParallelOptions(),
            initial_value=functools.partial(spec_of(cfg).initial_value, seed=0, cfg=cfg), model_inputs=2,
            context_parallel=mesh["cp"], cp_gather=cp_gather)
    return stages.modules[0]


@pytest.mark.parametrize(("cp_gather", "latent"), [("auto", True), ("latent", True), ("kv", False)])
def test_the_stage_gathers_what_the_plan_says(cp_gather, latent):
    stage = _built_stage(cp_gather)
    gathered = [m for m in stage.modules() if isinstance(m, GatheredLatent)]
    cores = [m for m in stage.modules() if isinstance(m, ContextParallelAttention)]
    assert cores and len(gathered) == (len(cores) if latent else 0)
    assert all(core.whole_keys is latent for core in cores)
