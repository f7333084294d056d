"""FSDP under pipelining reduces gradients once per step, not once per micro-batch; ZeRO-3 reduces them
after every micro-batch instead (so no rank ever holds a whole stage's gradients), and a lower reduce
dtype is what goes on the wire."""

from __future__ import annotations

import json
import os

import pytest

from tests.launch import QUICK_RUN, spawn_ranks
from tests.step_hook import after_backward

pytestmark = pytest.mark.slow  # real multi-process jobs
MICROBATCHES = 4


def _count_reductions(out_dir: str, extra: list[str]) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    import run

    calls = {"n": 0, "dtypes": set()}
    original = _fsdp_param_group.foreach_reduce

    def counting_reduce(fsdp_params, unsharded_grads, group, stream, comm, orig_dtype, reduce_dtype, *args, **kwargs):
        # One call = one unit's reduce-scatter; the gradients go on the wire in reduce_dtype (None: their own).
        calls["n"] += 1
        calls["dtypes"] |= {str(reduce_dtype or unsharded_grads[0].dtype)}
        return original(fsdp_params, unsharded_grads, group, stream, comm, orig_dtype, reduce_dtype, *args, **kwargs)

    _fsdp_param_group.foreach_reduce = counting_reduce
    per_step = []

    def record(step, ctx):
        # FSDP units that manage parameters (a stage root whose only parameters live in blocks has none).
        units = sum(isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
                    for module in ctx.stages.modules for m in module.modules())
        per_step.append({"reductions": calls["n"], "fsdp_units": units, "dtypes": sorted(calls["dtypes"])})
        calls["n"] = 0

    argv = ["--dp=2", "--pp=2", "--mp=1", "--model", "tiny", "--steps", "2",
            "--microbatches", str(MICROBATCHES), "--micro-batch-size", "1", "--seq-len", "32",
            "--logdir", out_dir, *QUICK_RUN, *extra]
    after_backward(record)
    assert run.main(argv) == 0
    with open(f"{out_dir}/rank{os.environ['RANK']}.json", "w") as f:
        json.dump(per_step, f)


@pytest.mark.parametrize("extra,per_microbatch,dtype", [
    (["--precision", "fp32"], False, "torch.float32"),
    (["--precision", "bf16", "--reshard-after-forward", "--reduce-dtype", "bf16"], True, "torch.bfloat16"),
], ids=["fsdp-fp32", "zero3-bf16-reduce"])
def test_reduce_scatters_per_fsdp_unit(tmp_path, extra, per_microbatch, dtype):
    spawn_ranks(_count_reductions, world_size=4, args=(str(tmp_path), extra), timeout=300)
    for rank in range(4):
        for step in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            assert step["fsdp_units"] > 0
            # Counted once the schedule's step (its final REDUCE_GRAD included) has run.
            expected = step["fsdp_units"] * MICROBATCHES if per_microbatch else step["fsdp_units"]
            assert step["reductions"] == expected, (rank, step)
            assert step["dtypes"] == [dtype], (rank, step)
