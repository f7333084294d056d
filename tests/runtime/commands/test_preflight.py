"""The memory preflight: the README's GPT-2 Large command is refused before anything is built, naming
flags that fit, and accepted with them; a GPU's memory is checked per device. No training here: the
decision is the memory model's (seconds), the command itself needs the whole machine for minutes."""

from __future__ import annotations

import pytest

from runtime.commands import train
from runtime.commands.flags import parse_train_config
from runtime.commands.preflight import GIB, NodeMemory, check_memory, node_ram, node_ranks
from runtime.config import ConfigError
from runtime.distributed.process_group import LaunchEnv

# README, "GPT-2 Large (774M) on 8 CPU ranks", without its three memory flags.
LARGE = ["--dp", "2", "--pp", "2", "--mp", "2", "--model", "large", "--seq-len", "256", "--precision", "bf16",
         "--micro-batch-size", "1", "--microbatches", "4", "--steps", "3"]
MEMORY_FLAGS = ["--reshard-after-forward", "--activation-checkpointing", "--compact-cpu-memory"]
THIS_MACHINE = NodeMemory(total=24_683_656 * 1024, available=23 * GIB)  # MemTotal of the 24 GiB machines here


def _check(argv, memory=THIS_MACHINE, world=8):
    cfg = parse_train_config(argv, world_size=world)
    return check_memory(cfg, world=world, node_ranks=list(range(world)), memory=memory)


def test_the_readme_large_command_without_its_memory_flags_is_refused_with_the_flags_that_fit():
    with pytest.raises(ConfigError) as refused:
        _check(LARGE)
    message = str(refused.value)
    assert all(flag in message for flag in MEMORY_FLAGS), message
    need = float(message.split("predicted memory ")[1].split(" GiB")[0])
    assert need > 23.5  # it was OOM-killed at 23.5 GiB used; the model says it needs more than the machine
    assert _check(LARGE + MEMORY_FLAGS) is None  # the README's command: 19.1 GiB measured


def test_a_fix_keeps_what_the_user_already_gave():
    with pytest.raises(ConfigError, match="add --reshard-after-forward --compact-cpu-memory"):
        _check(LARGE + ["--activation-checkpointing"])


def test_a_prediction_above_free_memory_but_within_the_budget_warns():
    busy = NodeMemory(total=THIS_MACHINE.total, available=10 * GIB)
    warning = _check(LARGE + MEMORY_FLAGS, memory=busy)
    assert warning.startswith("warning:") and "10.0 GiB is free" in warning


def test_when_no_flag_is_enough_a_plan_is_named():
    small_node = NodeMemory(total=10 * GIB, available=10 * GIB)
    with pytest.raises(ConfigError, match="a plan that fits: --dp"):
        _check(["--dp", "4", "--model", "medium", "--seq-len", "128", "--precision", "bf16",
                "--micro-batch-size", "4", "--microbatches", "1"], memory=small_node, world=4)


def test_a_gpu_is_checked_per_device():
    h100 = NodeMemory(total=80 * GIB, per_device=True)
    assert _check(LARGE, memory=h100) is None  # 3.5 GiB of tensors on an 80 GiB device
    tiny_device = NodeMemory(total=5 * GIB, per_device=True)
    with pytest.raises(ConfigError, match="per GPU"):
        _check(LARGE, memory=tiny_device)
    assert h100.per_device


def test_meminfo_and_node_ranks(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683656 kB\nMemFree:        21665808 kB\nMemAvailable:   23051388 kB\n")
    ram = node_ram(meminfo)
    assert ram.total == 24683656 * 1024 and ram.available == 23051388 * 1024 and not ram.per_device
    assert node_ram(tmp_path / "missing") is None
    assert node_ranks(rank=11, local_world_size=8) == list(range(8, 16))


def test_train_checks_memory_before_any_process_group(monkeypatch):
    """runtime/commands/train.py's check_inputs, as each of the 8 ranks runs it: refused in well under the
    issue's 3 minutes (the model is priced in closed form), unless --skip-memory-check."""
    monkeypatch.setattr(train, "node_memory", lambda local_rank, device_type: THIS_MACHINE)
    env = LaunchEnv(rank=3, world_size=8, local_rank=3, local_world_size=8)
    with pytest.raises(ConfigError, match="--reshard-after-forward --activation-checkpointing --compact-cpu-memory"):
        train.check_inputs(LARGE, env)
    cfg, _, _ = train.check_inputs([*LARGE, "--skip-memory-check"], env)
    assert cfg.plan.world == 8


def test_lora_is_priced_as_a_frozen_model_and_fits_where_full_training_does_not():
    """README's LoRA row: Llama 3.2 1B blocks x 4 with its whole vocabulary at 2x2x2 fp32 on this machine; full
    training is refused, LoRA rank 16 (the base's weights alone, the adapters trained) runs."""
    llama = ["--dp", "2", "--pp", "2", "--mp", "2", "--model", "llama3-1b", "--layers", "4", "--seq-len", "64",
             "--micro-batch-size", "1", "--microbatches", "4", "--precision", "fp32"]
    with pytest.raises(ConfigError, match="would not fit"):
        _check(llama)
    assert _check([*llama, "--lora-rank", "16"]) is None
