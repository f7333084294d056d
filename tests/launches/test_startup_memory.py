"""Start-up memory is a rank's share of the model: stages are built on the meta device and only the
rank's shards get storage, never the whole model."""

from __future__ import annotations

import datetime
import json
import os

import pytest

from tests.launch import spawn_ranks

pytestmark = pytest.mark.slow  # real multi-process jobs

# ~840 MB of fp32 parameters in all (16 blocks of d 1024, vocabulary 8192), a quarter of them per
# pipeline rank: large next to what the process allocates for anything else, so the stages stand out.
MODEL = dict(n_layers=16, d_model=1024, n_heads=8, seq_len=64, vocab_size=8192, mlp_width=4096)
PP = 4


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _build_and_measure(out_dir: str) -> None:
    import functools

    import torch
    import torch.distributed as dist

    from compiler.parallelize.data_parallel import DataParallelOptions
    from compiler.parallelize.stages import StageMeshes, build_local_stages
    from compiler.partition import uniform_split
    from compiler.schedules import SCHEDULES
    from models import config_from_dict, spec_of
    from runtime.device import peak_memory_bytes
    from runtime.distributed.mesh import GridLayout, build_mesh, fsdp_mesh

    dist.init_process_group("gloo")
    cfg = config_from_dict(MODEL)
    layout = GridLayout(1, PP, 1)
    mesh = build_mesh("cpu", layout, timeout=datetime.timedelta(seconds=120))
    _, pp_rank, _ = layout.coordinates(dist.get_rank())
    before = _rss()
    stages = build_local_stages(
        cfg, blocks_per_stage=uniform_split(cfg.n_layers, PP),
        stage_indices=SCHEDULES["1f1b"].stage_indices(pp_rank, pp=PP, stages_per_rank=1), micro_batch_size=1,
        meshes=StageMeshes(pp=mesh["pp"], mp=mesh["mp"], fsdp=fsdp_mesh(mesh, layout, timeout=datetime.timedelta(seconds=120))),
        device=torch.device("cpu"), activation_checkpointing="none", data_parallel=DataParallelOptions(),
        initial_value=functools.partial(spec_of(cfg).initial_value, seed=0, cfg=cfg))
    peak = peak_memory_bytes(torch.device("cpu"))  # this process's own high-water mark, not its parent's
    held = sum(p.numel() * p.element_size() for p in stages.parameters())
    with open(f"{out_dir}/rank{dist.get_rank()}.json", "w") as f:
        json.dump({"growth": peak - before, "held": held}, f)
    dist.destroy_process_group()


def test_a_rank_allocates_its_share_of_the_model_not_the_whole_model(tmp_path):
    from models import config_from_dict, parameter_count

    spawn_ranks(_build_and_measure, world_size=PP, args=(str(tmp_path),), timeout=300)
    model_bytes = 4 * parameter_count(config_from_dict(MODEL))
    for rank in range(PP):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # The peak growth covers the stage's parameters (4 blocks, and the embedding or the head's copy
        # of it) plus the largest full parameter generated to cut a shard from: well below the model,
        # which every rank used to build whole before keeping its stages.
        assert r["growth"] < 0.5 * model_bytes, (rank, r, model_bytes)
        assert r["held"] < 0.5 * model_bytes
