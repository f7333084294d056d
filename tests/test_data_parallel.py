"""FSDP under pipelining reduces gradients once per step, not once per micro-batch."""

from __future__ import annotations

import json
import os

import pytest

from tests.launch import spawn_ranks
from tests.step_hook import after_backward

pytestmark = pytest.mark.slow  # real multi-process jobs
MICROBATCHES = 4


def _count_reductions(out_dir: str) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    import run

    calls = {"n": 0}
    original = _fsdp_param_group.foreach_reduce

    def counting_reduce(*args, **kwargs):  # one call = one reduce-scatter of one FSDP unit's gradients
        calls["n"] += 1
        return original(*args, **kwargs)

    _fsdp_param_group.foreach_reduce = counting_reduce
    per_step = []

    def record(step, ctx):
        # FSDP units that manage parameters (a stage root whose only parameters live in blocks has none).
        units = sum(isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
                    for module in ctx.stages.modules for m in module.modules())
        per_step.append({"reductions": calls["n"], "fsdp_units": units})
        calls["n"] = 0

    argv = ["--dp=2", "--pp=2", "--mp=1", "--model", "tiny", "--precision", "fp32", "--steps", "2",
            "--microbatches", str(MICROBATCHES), "--micro-batch-size", "1", "--seq-len", "32",
            "--logdir", out_dir, "--peak-tflops", "1", "--eval-every", "0", "--eval-batches", "1"]
    after_backward(record)
    assert run.main(argv) == 0
    with open(f"{out_dir}/rank{os.environ['RANK']}.json", "w") as f:
        json.dump(per_step, f)


def test_one_reduce_scatter_per_fsdp_unit_per_step(tmp_path):
    spawn_ranks(_count_reductions, world_size=4, args=(str(tmp_path),), timeout=300)
    for rank in range(4):
        for step in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            assert step["fsdp_units"] > 0
            assert step["reductions"] == step["fsdp_units"], (rank, step)
