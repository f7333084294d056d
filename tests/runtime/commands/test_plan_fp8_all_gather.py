"""``run.py plan`` and ``--auto`` take --fp8-all-gather: refused with train's own one-line error where no layout the
flags leave open could run it, held on or off when given, and given back by ``plan_flags`` for the chosen plan."""

from __future__ import annotations

import json

import pytest

from compiler.parallel_plan import ParallelPlan
from runtime.commands import plan as plan_command
from runtime.commands.flag_table import plan_flags
from runtime.commands.flags import build_config, build_parser
from runtime.config import ConfigError, validate

PLAN = ["--cluster", "h100-80gb", "--world", "8", "--model", "llama3-8b", "--top", "1"]


def _train_error(flags: list[str]) -> str:
    """The line train prints for these flags at 8 ranks."""
    with pytest.raises(ConfigError) as e:
        validate(build_config(build_parser().parse_args(["--model", "llama3-8b", *flags])), world_size=8)
    return f"error: {e.value}"


@pytest.mark.parametrize("flags, train", [
    (["--fp8-all-gather"], ["--dp", "8", "--fp8-all-gather"]),
    (["--fp8", "rowwise", "--fp8-all-gather"], ["--dp", "8", "--fp8", "rowwise", "--fp8-all-gather"]),
    (["--fp8", "tensorwise", "--fp8-all-gather", "--dp-mode", "replicate"],
     ["--dp", "8", "--dp-shard", "1", "--fp8", "tensorwise", "--fp8-all-gather"]),
    (["--fp8", "tensorwise", "--fp8-all-gather", "--dp", "1", "--cp", "1"],
     ["--pp", "8", "--fp8", "tensorwise", "--fp8-all-gather"]),
])
def test_plan_refuses_what_train_refuses_in_train_words(flags, train, capsys):
    assert plan_command.main([*PLAN, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.strip() == _train_error(train)


@pytest.mark.parametrize("flag, gathers", [("--fp8-all-gather", True), ("--no-fp8-all-gather", False), (None, True)])
def test_plan_holds_the_flag_or_chooses_it(flag, gathers, tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = [*PLAN, "--fp8", "tensorwise", "--dp", "8", "--json", str(out), *([flag] if flag else [])]
    assert plan_command.main(argv) == 0
    best = json.loads(out.read_text())["best"]
    assert best["fp8_all_gather"] is gathers and best["fp8"] == "tensorwise"
    assert ("+fp8 all-gather" in capsys.readouterr().out) is gathers


def test_plan_flags_give_the_flag_back_to_train():
    plan = ParallelPlan(dp=8, microbatches=4, micro_batch_size=1, precision="bf16", fp8="tensorwise",
                        fp8_all_gather=True)
    flags = plan_flags(plan)
    assert "--fp8-all-gather" in flags and "--fp8-all-gather" not in plan_flags(
        ParallelPlan(dp=8, fp8="tensorwise"))
    cfg = build_config(build_parser().parse_args(["--model", "llama3-1b", *flags]))
    assert cfg.plan.fp8_all_gather and cfg.plan.fp8 == "tensorwise"


def test_auto_holds_the_flag_and_refuses_it_in_trains_words(monkeypatch):
    """--auto on an H100 (faked), world 8."""
    import torch

    from runtime.commands import auto

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    base = ["--auto", "--model", "llama3-1b", "--precision", "bf16", "--global-batch-size", "16"]
    argv = [*base, "--fp8", "tensorwise", "--fp8-all-gather"]
    cfg, best, notes = auto.auto_config(build_parser().parse_args(argv), argv, world=8)
    assert cfg.plan.fp8_all_gather and cfg.plan == best.plan and "fp8_all_gather=(True,)" in notes[-1]
    argv = [*base, "--fp8", "rowwise", "--fp8-all-gather"]
    with pytest.raises(ConfigError) as e:
        auto.auto_config(build_parser().parse_args(argv), argv, world=8)
    assert f"error: {e.value}" == _train_error(["--dp", "8", "--fp8", "rowwise", "--fp8-all-gather"])
