"""compiler/parallel_plan.py: a DP mode's name and the plan fields it stands for, both ways."""

from __future__ import annotations

import pytest

from compiler.parallel_plan import ParallelPlan, dp_shard_of_mode, is_dp_mode


@pytest.mark.parametrize(("dp", "dp_shard", "mode"), [(4, None, "fsdp"), (4, 4, "fsdp"), (4, 1, "replicate"),
                                                     (4, 2, "hsdp:2"), (8, 4, "hsdp:4")])
def test_a_mode_name_gives_back_the_shard_it_was_named_from(dp, dp_shard, mode):
    plan = ParallelPlan(dp=dp, dp_shard=dp_shard)
    assert plan.dp_mode == mode and is_dp_mode(mode)
    assert ParallelPlan(dp=dp, dp_shard=dp_shard_of_mode(mode)).shard == plan.shard


@pytest.mark.parametrize("mode", ["none", "zero3", "fsdp"])
def test_modes_without_a_shard_count_shard_over_every_dp_rank(mode):
    assert dp_shard_of_mode(mode) is None
