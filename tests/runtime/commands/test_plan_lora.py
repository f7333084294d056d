"""``run.py plan --lora-rank R``: the planner prices a LoRA run (the model frozen: no gradient, no AdamW state; the
adapters trained) with the flags training reads."""

from __future__ import annotations

import json

import pytest

from models import named_config, parameter_count
from runtime.commands import plan as plan_command

LAYOUT = ["--cluster", "h100-80gb", "--world", "8", "--model", "llama3-8b", "--global-batch-size", "64", "--dp", "8",
          "--pp", "1", "--mp", "1", "--micro-batch-size", "1", "--dp-mode", "fsdp", "--activation-checkpointing", "full"]


def _priced(tmp_path, *extra: str) -> dict:
    out = tmp_path / "plan.json"
    assert plan_command.main([*LAYOUT, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())["priced"]


def test_a_lora_run_is_priced_without_the_frozen_models_gradients_and_adamw_state(tmp_path, capsys):
    full, lora = _priced(tmp_path), _priced(tmp_path, "--lora-rank", "16")
    assert "LoRA rank 16 on q,k,v,o,gate,up,down" in capsys.readouterr().out
    # FSDP over 8 ranks: full training keeps an fp32 gradient (4 B) and AdamW's two moments (8 B) per parameter shard
    states = 12 * parameter_count(named_config("llama3-8b")) / 8 / 2**30
    assert full["memory_gib_per_gpu"] - lora["memory_gib_per_gpu"] > states
    assert lora["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-3)  # the same products are run


def test_lora_targets_the_family_lacks_are_one_error_line(capsys):
    assert plan_command.main([*LAYOUT, "--lora-rank", "4", "--lora-targets", "qkv"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --lora-targets qkv:")


@pytest.mark.parametrize(("extra", "line"), [
    (["--lora-rank", "0"], "error: --lora-rank must be a positive number of dimensions, got 0"),
    (["--lora-rank", "4", "--lora-dropout", "1.5"], "error: --lora-dropout must be in [0, 1), got 1.5"),
    (["--lora-rank", "4", "--mtp-depth", "1"], "error: --mtp-depth 1 with --lora-rank: fine-tuning trains without "
                                               "multi-token prediction; use --mtp-depth 0"),
])
def test_lora_settings_train_refuses_are_one_error_line(run_main, extra, line):
    printed = run_main(plan_command.main, [*LAYOUT, *extra])
    assert printed.code == 2 and printed.err.splitlines() == [line] and not printed.out, printed
