"""--fp8 in the run config (runtime/config.py ``_check_fp8``): the plan field and its flag both ways, and the one-line
errors for what no mesh can run exactly (blockwise's 128-wide blocks cut by a shard), --fp8 any without a planner
and --compile."""

from __future__ import annotations

import pytest

from runtime.commands.flag_table import fp8_choices, plan_flags
from runtime.commands.flags import parse_train_config
from runtime.config import ConfigError

LLAMA_256 = ["--model", "llama3-debug", "--layers", "2", "--d-model", "256", "--heads", "4", "--kv-heads", "4",
             "--mlp-width", "512"]
MOE_256 = ["--model", "qwen3-moe-debug", "--d-model", "256", "--heads", "16", "--kv-heads", "16"]


def test_the_recipe_is_a_plan_field_and_its_flag_round_trips():
    cfg = parse_train_config(["--fp8", "rowwise", "--precision", "fp32"], world_size=1)
    assert cfg.plan.fp8 == "rowwise" and cfg.to_dict()["plan"]["fp8"] == "rowwise"
    assert plan_flags(cfg.plan)[-2:] != ["--fp8", "None"] and "--fp8" in plan_flags(cfg.plan)
    assert parse_train_config(plan_flags(cfg.plan), world_size=1).plan == cfg.plan
    plain = parse_train_config(["--precision", "fp32"], world_size=1).plan
    assert plain.fp8 is None and "--fp8" not in plan_flags(plain)
    assert "fp8=rowwise" in cfg.plan.describe()


def test_the_planner_chooses_a_recipe_only_when_asked():
    assert fp8_choices(None) == (None,)
    assert fp8_choices("blockwise") == ("blockwise",)
    assert fp8_choices("any") == (None, "tensorwise", "rowwise", "blockwise")


@pytest.mark.parametrize(("argv", "world", "words"), [
    (["--fp8", "any"], 1, ["--fp8 any", "--auto"]),
    (["--fp8", "tensorwise", "--compile"], 1, ["--fp8 tensorwise", "--compile"]),
    # GQA's k at d 64: 2 kv heads x 16 = 32 rows, 16 per rank, inside one 128-row block
    (["--model", "llama3-debug", "--mp", "2", "--fp8", "blockwise"], 2, ["--fp8 blockwise", "layers.0.attn.q", "128"]),
    # 2 cp chunks of T / 4 = 16 tokens each: the weight gradient's 128-token tiles straddle ranks
    ([*LLAMA_256, "--seq-len", "64", "--cp", "2", "--fp8", "blockwise"], 2, ["--seq-len", "512"]),
    # a mixture's experts under SP see each mp rank's own tokens
    ([*MOE_256, "--mp", "2", "--sequence-parallel", "--fp8", "blockwise"], 2, ["mixture", "sequence parallelism"]),
])
def test_what_no_mesh_can_run_exactly_is_one_line_naming_the_flag(argv, world, words):
    with pytest.raises(ConfigError) as e:
        parse_train_config([*argv, "--precision", "fp32"], world_size=world)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize(("argv", "world"), [
    ([*LLAMA_256, "--mp", "2", "--sequence-parallel", "--fp8", "blockwise"], 2),  # every shard whole blocks
    ([*LLAMA_256, "--seq-len", "512", "--cp", "2", "--fp8", "blockwise"], 2),  # chunks of 128 tokens
    ([*MOE_256, "--mp", "2", "--dp", "2", "--ep", "2", "--fp8", "blockwise"], 4),  # EP: each source's rows apart
    (["--model", "llama3-debug", "--mp", "2", "--sequence-parallel", "--fp8", "tensorwise"], 2),  # scales reduced
    ([*MOE_256, "--mp", "2", "--sequence-parallel", "--cp", "2", "--fp8", "rowwise"], 4),
])
def test_meshes_that_keep_whole_blocks_or_reduce_their_scales_are_accepted(argv, world):
    assert parse_train_config([*argv, "--precision", "fp32"], world_size=world).plan.fp8 == argv[-1]


def test_fp8_all_gather_is_a_plan_field_whose_flag_round_trips():
    cfg = parse_train_config(["--dp", "2", "--fp8", "tensorwise", "--fp8-all-gather", "--precision", "fp32"], world_size=2)
    assert cfg.plan.fp8_all_gather and "--fp8-all-gather" in plan_flags(cfg.plan)
    assert parse_train_config(plan_flags(cfg.plan), world_size=2).plan == cfg.plan
    assert "fp8 all-gather" in cfg.plan.describe()
    plain = parse_train_config(["--dp", "2", "--fp8", "tensorwise"], world_size=2).plan
    assert not plain.fp8_all_gather and "--fp8-all-gather" not in plan_flags(plain)


@pytest.mark.parametrize(("argv", "world", "words"), [
    (["--dp", "2", "--fp8", "rowwise", "--fp8-all-gather"], 2, ["--fp8-all-gather", "--fp8 tensorwise", "rowwise"]),
    (["--dp", "2", "--fp8-all-gather"], 2, ["--fp8-all-gather", "no --fp8"]),
    (["--fp8", "tensorwise", "--fp8-all-gather"], 1, ["--fp8-all-gather", "sharded", "--dp 1"]),
    (["--dp", "2", "--dp-shard", "1", "--fp8", "tensorwise", "--fp8-all-gather"], 2, ["--fp8-all-gather", "--dp-shard 1"]),
])
def test_fp8_all_gather_needs_tensorwise_and_sharded_data_parallelism(argv, world, words):
    with pytest.raises(ConfigError) as e:
        parse_train_config(argv, world_size=world)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
