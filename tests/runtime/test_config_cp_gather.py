"""--cp-gather in the run config (runtime/config.py ``check_cp_gather``): the plan field and its flag both ways
(``plan_flags`` gives it back, leaving out the default ``auto``), and the one-line errors for ``latent`` on a model
without latent attention or with --fp8; ``kv`` runs on any model."""

from __future__ import annotations

import pytest

from runtime.commands.flag_table import plan_flags
from runtime.commands.flags import parse_train_config
from runtime.config import ConfigError

DEEPSEEK = ["--model", "deepseek-v3-debug", "--precision", "fp32"]


@pytest.mark.parametrize("choice", ["latent", "kv"])
def test_the_choice_is_a_plan_field_and_its_flag_round_trips(choice):
    cfg = parse_train_config([*DEEPSEEK, "--cp", "2", "--cp-gather", choice], world_size=2)
    assert cfg.plan.cp_gather == choice and cfg.to_dict()["plan"]["cp_gather"] == choice
    flags = plan_flags(cfg.plan)
    assert flags[flags.index("--cp-gather") + 1] == choice
    assert parse_train_config([*DEEPSEEK, *flags], world_size=2).plan == cfg.plan
    assert f"cp-gather={choice}" in cfg.plan.describe()


def test_auto_is_the_default_and_left_out_of_the_flags():
    plan = parse_train_config([*DEEPSEEK, "--cp", "2"], world_size=2).plan
    assert plan.cp_gather == "auto" and "--cp-gather" not in plan_flags(plan) and "cp-gather" not in plan.describe()


def test_keys_and_values_are_gathered_on_any_model():
    assert parse_train_config(["--model", "llama3-debug", "--cp", "2", "--cp-gather", "kv"], world_size=2).plan.cp_gather == "kv"


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "llama3-debug", "--cp", "2", "--cp-gather", "latent"],
     "--cp-gather latent needs multi-head latent attention (DeepSeek-V2/V3): this model has none; "
     "use --cp-gather auto or kv"),
    ([*DEEPSEEK, "--cp", "2", "--fp8", "tensorwise", "--cp-gather", "latent"],
     "--cp-gather latent cannot run with --fp8 (the latent path leaves kv_b partial gradients FP8 would round on grids "
     "of their own); use --cp-gather auto or kv"),
])
def test_latent_without_latent_attention_or_with_fp8_is_one_error_line(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_train_config(argv, world_size=2)
    assert str(e.value) == message


def test_an_unknown_choice_is_refused_by_the_parser():
    with pytest.raises(ConfigError, match=r"^argument --cp-gather: invalid choice: 'keys' \(choose from '?auto'?, "
                                          r"'?latent'?, '?kv'?\)"):
        parse_train_config([*DEEPSEEK, "--cp-gather", "keys"], world_size=1)
