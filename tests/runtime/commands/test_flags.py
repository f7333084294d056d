"""Each subcommand offers only the flags it uses (runtime/commands/flag_groups.py): ``eval`` builds its parser
from training's groups that evaluation reads, so ``run.py eval --help`` lists no optimiser, checkpoint-writing
or metrics flag, and every subcommand still accepts the flags its documentation shows."""

from __future__ import annotations

import argparse

import pytest

from runtime.commands import eval as eval_command
from runtime.commands import export, generate, plan
from runtime.commands.flag_groups import build_parser, with_training_defaults
from runtime.commands.flags import config_from_args
from runtime.config import ConfigError
from runtime.lab import calibrate, data_benchmark
from runtime.lab.study import cli as study
from tests.paths import FIXTURE_ROOT

PARSERS = {"eval": eval_command.build_parser, "generate": generate.build_parser, "export": export.build_parser,
           "plan": plan.build_arg_parser, "study": study.build_parser, "calibrate": calibrate.build_parser,
           "data-benchmark": data_benchmark.build_parser}

# Flags only training reads: no subcommand offers them.
TRAINING_ONLY = ("--lr", "--warmup-steps", "--weight-decay", "--grad-clip", "--stop-at-step", "--checkpoint-dir",
                 "--checkpoint-every", "--keep-checkpoints", "--async-checkpoint", "--resume", "--resume-from",
                 "--max-bad-steps", "--min-loss-scale", "--val-fraction", "--eval-every", "--eval-batches",
                 "--logdir", "--log-every", "--peak-tflops", "--profile", "--profile-memory", "--split-cost",
                 "--bind-cores", "--compact-cpu-memory", "--skip-memory-check", "--compile", "--auto",
                 "--mtp-loss-weight")

# What each subcommand's documentation (README, its module docstring) runs it with.
ACCEPTED = {
    "eval": ["--checkpoint", "ckpt", "--data", "val.bin", "--dp", "2", "--pp", "2", "--mp", "2", "--dp-shard", "1",
             "--micro-batch-size", "2", "--microbatches", "4", "--schedule", "1f1b", "--precision", "bf16",
             "--seq-len", "32", "--token-dtype", "uint32", "--data-format", "nanogpt", "--seed", "3"],
    "generate": ["--init-from", "folder", "--prompt-ids", "1,2", "--max-new-tokens", "4", "--temperature", "0",
                 "--top-k", "5", "--seed", "1"],
    "export": ["--checkpoint", "ckpt", "--out", "o", "--format", "hf", "--max-shard-size", "1GB", "--dtype", "bf16"],
    "plan": ["--cluster", "h100-80gb", "--world", "64", "--model", "llama3-8b", "--seq-len", "4096", "--dp", "8",
             "--pp", "2", "--mp", "4", "--json", "p.json"],
    "study": ["--world", "4", "--quick", "--sections", "throughput"],
    "calibrate": ["--engine-world", "0", "--out", "c.json"],
    "data-benchmark": ["--gigabytes", "0.1", "--ranks", "2", "--steps", "3"],
}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


@pytest.mark.parametrize("command", list(PARSERS))
def test_no_subcommand_offers_a_training_only_flag(command):
    offered = _options(PARSERS[command]()) & set(TRAINING_ONLY)
    assert not offered, f"run.py {command} offers {sorted(offered)}"


def test_eval_help_lists_no_optimiser_checkpoint_or_metrics_flag():
    text = eval_command.build_parser().format_help()
    for flag in ("--lr", "--steps", "--checkpoint-every", "--warmup-steps", "--logdir", "--eval-every"):
        assert f"{flag} " not in text and f"{flag}\n" not in text, flag
    assert "--micro-batch-size" in text and "--data " in text  # what it uses stays
    with pytest.raises(ConfigError, match="unrecognized arguments: --lr"):
        eval_command.build_parser().parse_args(["--checkpoint", "c", "--lr", "1e-3"])


@pytest.mark.parametrize("command", list(PARSERS))
def test_each_subcommand_accepts_the_flags_it_uses(command):
    args = PARSERS[command]().parse_args(ACCEPTED[command])
    assert args is not None


def test_evals_flags_are_trainings_and_build_a_config():
    training = {a.dest for a in build_parser()._actions}
    ours = {a.dest for a in eval_command.build_parser()._actions}
    assert ours - training == {"checkpoint"}  # every other flag is one build_config reads
    args = eval_command.build_parser().parse_args(ACCEPTED["eval"])
    cfg = config_from_args(with_training_defaults(args), world_size=8)
    assert (cfg.plan.dp, cfg.plan.microbatches, cfg.plan.schedule, cfg.data.token_dtype) == (2, 4, "1f1b", "uint32")
    assert cfg.plan.shard == 1 and cfg.plan.precision == "bf16" and cfg.seed == 3
    default = config_from_args(with_training_defaults(eval_command.build_parser().parse_args(["--checkpoint", "c"])),
                               world_size=1)
    assert default.plan.precision == "fp32"  # evaluation's default, not training's


# ---- LoRA's flags (runtime/commands/flags.py lora_config, runtime/config.py check_lora) ------------------------------

PEFT_ADAPTER = str(FIXTURE_ROOT / "peft" / "llama3-lora")
LLAMA_FOLDER = str(FIXTURE_ROOT / "hf-models" / "llama3")


def _lora(argv: list[str]):
    return config_from_args(build_parser().parse_args(argv), world_size=1).lora


def test_lora_flags_give_the_config_and_the_family_s_default_targets():
    assert _lora(["--model", "tiny"]) is None
    lora = _lora(["--model", "tiny", "--lora-rank", "8"])
    assert (lora.rank, lora.alpha, lora.targets, lora.dropout, lora.base_dtype) == (8, 16.0, ("qkv", "o", "up", "down"),
                                                                                    0.0, "fp32")
    lora = _lora(["--model", "llama3-debug", "--lora-rank", "4", "--lora-alpha", "4", "--lora-targets", "q,v",
                  "--lora-dropout", "0.1", "--lora-base-dtype", "bf16", "--precision", "bf16"])
    assert (lora.scale, lora.targets, lora.dropout, lora.base_dtype) == (1.0, ("q", "v"), 0.1, "bf16")
    assert _lora(["--model", "tiny", "--lora-rank", "4", "--lora-targets", " o, up,o "]).targets == ("o", "up")


def test_lora_from_a_peft_folder_takes_its_settings():
    lora = _lora(["--init-from", LLAMA_FOLDER, "--lora-from", PEFT_ADAPTER])
    assert (lora.rank, lora.alpha, set(lora.targets), lora.init_from) == (
        4, 8.0, {"q", "k", "v", "o", "gate", "up", "down"}, PEFT_ADAPTER)
    assert _lora(["--init-from", LLAMA_FOLDER, "--lora-from", PEFT_ADAPTER, "--lora-rank", "4",
                  "--lora-dropout", "0.2"]).dropout == 0.2  # a training setting: the flag's


@pytest.mark.parametrize("argv,message", [
    (["--lora-alpha", "8"], "--lora-alpha needs --lora-rank R"),
    (["--lora-base-dtype", "bf16"], "--lora-base-dtype needs --lora-rank R"),
    (["--lora-rank", "0"], "--lora-rank must be a positive"),
    (["--lora-rank", "4", "--lora-alpha", "-1"], "--lora-alpha must be positive"),
    (["--lora-rank", "4", "--lora-dropout", "1"], r"--lora-dropout must be in \[0, 1\)"),
    (["--lora-rank", "4", "--lora-targets", "q,v"], "--lora-targets q,v: q, v is not a module of gpt2's blocks; valid "
                                                    "targets: qkv, o, up, down"),
    (["--lora-rank", "4", "--lora-targets", "experts"], "experts is not a module"),
    (["--lora-rank", "4", "--lora-targets", ""], "^--lora-targets '': no target given; valid targets: qkv, o, up, down$"),
    (["--lora-rank", "4", "--lora-targets", " , "], "^--lora-targets '': no target given; valid targets: qkv, o, up, down$"),
    (["--lora-rank", "4", "--lora-base-dtype", "bf16", "--precision", "fp32"], "needs --precision bf16"),
    (["--init-from", LLAMA_FOLDER, "--lora-from", PEFT_ADAPTER, "--lora-rank", "8"],
     "--lora-rank 8 differs from --lora-from .*'s 4"),
    (["--lora-from", "no/such/folder"], r"^--lora-from no/such/folder: no/such/folder/adapter_config.json: missing \(a "
                                        "peft adapter folder holds adapter_config.json and adapter_model.safetensors"),
])
def test_bad_lora_flags_are_one_line_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        _lora(["--model", "tiny", *argv] if "--init-from" not in argv else argv)


def test_fine_tuning_leaves_a_folders_mtp_depths_out_and_refuses_them_asked_for():
    """DeepSeek-V3's folder names one MTP depth (num_nextn_predict_layers): pre-training trains it, LoRA trains the
    next-token objective alone; --mtp-depth 1 with LoRA is one line naming both flags."""
    folder = str(FIXTURE_ROOT / "hf-models" / "deepseek-v3")

    def config(*argv: str):
        return config_from_args(build_parser().parse_args(["--init-from", folder, *argv]), world_size=1)

    assert config().model.mtp_depth == 1
    assert config("--lora-rank", "4").model.mtp_depth == 0
    with pytest.raises(ConfigError, match="--mtp-depth 1 with --lora-rank: .* use --mtp-depth 0"):
        config("--lora-rank", "4", "--mtp-depth", "1")
