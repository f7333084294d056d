"""Multi-token prediction in the planner and the engine's cost model: the depths (models/common/mtp.py) are priced with
the head, on the last stage: parameters as the built models count them, FLOPs and saved activations as the engine's
profile counts them, each depth's block, projection and head in the head's seconds, in the last rank's memory, and
in the engine's stage split; ``run.py plan --mtp-depth`` prices them as given."""

from __future__ import annotations

import dataclasses

import pytest

from compiler.cost import layer_costs
from compiler.parallel_plan import ParallelPlan
from compiler.planner.activations import analytic_layer_costs
from compiler.planner.cluster import load_cluster
from compiler.planner.engines import THIS_ENGINE
from compiler.planner.layers import Setup, layer_table
from compiler.planner.search import Pricer
from compiler.planner.shape import DecoderShape, activated_parameter_count, parameter_count
from compiler.planner.work import HEAD
from compiler.stage_plan import plan_stages
from models import FAMILIES, named_config
from models import activated_parameter_count as built_activated
from models import parameter_count as built_count
from runtime.commands.plan import build_arg_parser
from runtime.commands.plan_flags import shape_from_args
from runtime.config import ConfigError

H100 = load_cluster("h100-80gb")


@pytest.mark.parametrize("size", sorted({spec.debug_size for spec in FAMILIES.values()} | {"deepseek-v3-16b-debug"}))
def test_the_planners_parameter_counts_are_the_built_models(size):
    for depth in (0, 1, 2):
        cfg = dataclasses.replace(named_config(size), mtp_depth=depth)
        shape = DecoderShape.from_config(cfg)
        assert shape.mtp_depth == depth
        assert parameter_count(shape) == built_count(cfg) and activated_parameter_count(shape) == built_activated(cfg)


@pytest.mark.parametrize("mp", [1, 2])
def test_the_heads_closed_form_counts_the_depths_as_the_engines_profile_does(mp):
    cfg = dataclasses.replace(named_config("llama3-debug"), mtp_depth=2)
    engine = layer_costs(cfg, micro_batch_size=2, mp=mp)[-1]
    alone = layer_costs(dataclasses.replace(cfg, mtp_depth=0), micro_batch_size=2, mp=mp)[-1]
    priced = analytic_layer_costs(DecoderShape.from_config(cfg), micro_batch_size=2, mp=mp)[-1]
    assert engine.flops > 4 * alone.flops and engine.params > 4 * alone.params  # two blocks, two heads' passes more
    assert priced.flops == pytest.approx(engine.flops, rel=0.01) and priced.params == engine.params
    assert priced.activation_bytes == pytest.approx(engine.activation_bytes, rel=0.05)


def test_the_engines_split_gives_the_last_stage_fewer_blocks():
    split = {}
    for depth in (0, 2):
        cfg = dataclasses.replace(named_config("llama3-debug", n_layers=8), mtp_depth=depth)
        split[depth] = plan_stages(cfg, n_stages=2, micro_batch_size=2, split="auto", precision="fp32", mp=1,
                                   placement="looped").blocks_per_stage
    assert split[0] == [4, 4] and split[2][1] < 4 and sum(split[2]) == 8


def test_each_depth_adds_a_block_and_the_head_to_the_heads_seconds_and_the_last_ranks_memory():
    shape = DecoderShape.from_config(named_config("llama3-8b"))
    deep = dataclasses.replace(shape, mtp_depth=1)
    setup = Setup(micro_batch_size=1, precision="bf16", mp=8)
    table, with_depth = layer_table(shape, H100, THIS_ENGINE, setup), layer_table(deep, H100, THIS_ENGINE, setup)
    head, block = table.layers[HEAD].total, table.layers["dense"].total
    # Beyond a block and the head's second pass: the depth's input, mostly its [M, 2d] x [2d, d] projection, which
    # every mp rank runs whole (three products); no faster than at peak, no slower than at a quarter of it.
    rest = with_depth.layers[HEAD].total - (2 * head + block)
    projection = 3 * 2 * 8192 * (2 * shape.d_model) * shape.d_model / H100.device.peak_flops["bf16"]
    assert projection < rest < 4 * projection
    plan = ParallelPlan(dp=1, pp=2, mp=8, schedule="1f1b", stages_per_rank=1, microbatches=8, micro_batch_size=1,
                        precision="bf16")
    first, last = Pricer(shape, H100).rank_memories(plan), Pricer(deep, H100).rank_memories(plan)
    assert last[1] > first[1]  # the last pp rank holds the depth (its split also moves blocks off it)
    assert Pricer(deep, H100).price(plan).step_time > Pricer(shape, H100).price(plan).step_time


def test_run_plan_takes_the_depth_as_given():
    args = build_arg_parser().parse_args(["--world", "8", "--model", "deepseek-v3-16b", "--mtp-depth", "1"])
    assert shape_from_args(args).mtp_depth == 1
    assert shape_from_args(build_arg_parser().parse_args(["--world", "8", "--model", "deepseek-v3"])).mtp_depth == 0
    from runtime.commands.plan_flags import check_positive

    with pytest.raises(ConfigError, match="--mtp-depth must be >= 0"):
        check_positive(build_arg_parser().parse_args(["--world", "8", "--mtp-depth", "-1"]))
