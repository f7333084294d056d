"""``run.py plan`` and ``--auto`` take --cp-gather: held when given (``plan --json`` shows it), priced both ways
otherwise, refused with train's own one-line error where no plan could run it, and given back by ``plan_flags``."""

from __future__ import annotations

import json
import re

import pytest

from runtime.commands import plan as plan_command
from runtime.commands.flag_table import plan_flags
from runtime.commands.flags import build_config, build_parser
from runtime.config import ConfigError, validate

PLAN = ["--cluster", "h100-80gb", "--world", "16", "--model", "deepseek-v3-16b", "--cp", "4", "--dp", "4", "--top", "1"]


def _train_error(flags: list[str]) -> str:
    """The line train prints for these flags at 2 ranks."""
    with pytest.raises(ConfigError) as e:
        validate(build_config(build_parser().parse_args(flags)), world_size=2)
    return f"error: {e.value}"


@pytest.mark.parametrize("flag", [None, "latent", "kv"])
def test_plan_holds_the_choice_or_prices_both(flag, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_command.main([*PLAN, "--json", str(out), *(["--cp-gather", flag] if flag else [])]) == 0
    data = json.loads(out.read_text())
    priced = data["priced"]  # the layout the flags fix (--cp 4 --dp 4)
    assert priced["cp"] == 4 and priced["cp_gather"] in ((flag,) if flag else ("latent", "kv"))
    assert data["best"]["cp_gather"] == flag or flag is None  # the search over every layout holds it too
    assert re.search(rf"priced: 4x1x1 cp=4 .* cp-gather={priced['cp_gather']}:", capsys.readouterr().out)


def test_plan_flags_of_a_chosen_plan_train_it():
    flags = ["--model", "deepseek-v3-debug", "--cp", "2", "--cp-gather", "kv", "--precision", "fp32"]
    cfg = build_config(build_parser().parse_args(flags))
    again = build_config(build_parser().parse_args(["--model", "deepseek-v3-debug", *plan_flags(cfg.plan)]))
    assert again.plan == cfg.plan and again.plan.cp_gather == "kv"


@pytest.mark.parametrize("flags, train", [
    (["--cluster", "h100-80gb", "--world", "16", "--model", "llama3-8b", "--cp", "2", "--cp-gather", "latent"],
     ["--model", "llama3-debug", "--cp", "2", "--cp-gather", "latent"]),
    ([*PLAN, "--fp8", "tensorwise", "--cp-gather", "latent"],
     ["--model", "deepseek-v3-debug", "--cp", "2", "--fp8", "tensorwise", "--cp-gather", "latent"]),
])
def test_plan_refuses_what_train_refuses_in_train_words(flags, train, capsys):
    assert plan_command.main(flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.strip() == _train_error(train)


def test_auto_holds_the_choice_and_refuses_latent_in_trains_words(monkeypatch):
    """--auto on an H100 (faked), world 2, cp held at 2."""
    import torch

    from runtime.commands import auto

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    base = ["--auto", "--precision", "bf16", "--global-batch-size", "4", "--cp", "2"]
    argv = [*base, "--model", "deepseek-v3-debug", "--cp-gather", "kv"]
    cfg, best, notes = auto.auto_config(build_parser().parse_args(argv), argv, world=2)
    assert cfg.plan.cp_gather == "kv" and cfg.plan == best.plan and "cp_gather=('kv',)" in notes[-1]
    argv = [*base, "--model", "llama3-debug", "--cp-gather", "latent"]
    with pytest.raises(ConfigError) as e:
        auto.auto_config(build_parser().parse_args(argv), argv, world=2)
    assert f"error: {e.value}" == _train_error(["--model", "llama3-debug", "--cp", "2", "--cp-gather", "latent"])
