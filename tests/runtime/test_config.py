"""Config defaults and derivations (the error cases run end to end in test_bad_input.py)."""

import dataclasses

import pytest

from runtime.commands import flags
from runtime.commands.flags import build_parser, config_from_args, parse_train_config
from runtime.config import ConfigError, validate


@pytest.fixture(params=[False, True], ids=["slow-bf16", "fast-bf16"])
def fast_bf16(request, monkeypatch):
    """The device's bf16 speed as detected (runtime/device.py), faked: tests must not depend on the CPU."""
    seen = []
    monkeypatch.setattr(flags, "has_fast_bf16", lambda device_type: seen.append(device_type) or request.param)
    return request.param, seen


def test_defaults_for_a_plain_single_process(fast_bf16):
    fast, seen = fast_bf16
    cfg = parse_train_config([], world_size=1)
    assert (cfg.plan.dp, cfg.plan.pp, cfg.plan.mp) == (1, 1, 1)
    assert cfg.plan.schedule == "interleaved-1f1b"
    assert cfg.plan.stages_per_rank == 1  # no virtual stages without a pipeline
    # bf16 where the device computes it fast, else fp32; resolved before validation and in the printed config
    precision = "bf16" if fast else "fp32"
    assert cfg.plan.precision == precision and seen == [cfg.device]
    assert cfg.metrics.logdir.startswith(f"tensorboard_logs/tiny_dp1_pp1_mp1_interleaved-1f1b_{precision}_")
    assert cfg.to_dict()["plan"]["precision"] == precision


def test_fp16_with_loss_scaling_is_one_flag_away(fast_bf16):
    assert parse_train_config(["--precision", "fp16"], world_size=1).plan.precision == "fp16"


def test_interleaved_defaults_to_two_virtual_stages_and_2p_microbatches():
    cfg = parse_train_config(["--pp", "2", "--dp", "2", "--mp", "2"], world_size=8)
    assert cfg.plan.stages_per_rank == 2 and cfg.plan.microbatches == 4
    assert cfg.global_batch_size == 4 * 4 * 2


def test_microbatches_derive_from_global_batch():
    cfg = parse_train_config(["--dp", "2", "--global-batch-size", "32", "--micro-batch-size", "2"], world_size=2)
    assert cfg.plan.microbatches == 8 and cfg.global_batch_size == 32


def test_overrides_and_mlp_width_follow_d_model():
    cfg = parse_train_config(["--model", "small", "--layers", "2", "--d-model", "128", "--heads", "2"], world_size=1)
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.mlp_width, cfg.model.vocab_size) == (2, 128, 512, 50257)


def test_errors_raise_config_error_not_exit():
    with pytest.raises(ConfigError, match="--schedule"):
        config_from_args(build_parser().parse_args(["--schedule", "nope"]), world_size=1)


@pytest.mark.parametrize("world, argv, words", [
    (8, ["--dp", "2", "--pp", "2"], "valid meshes: 1x1x8, 1x2x4"),
    (8, ["--dp", "2", "--cp", "2"], "valid meshes: 1x1x4, 1x2x2, 1x4x1, 2x1x2, 2x2x1, 4x1x1 (times --cp 2)"),
    # No dp x pp x mp completes --cp 3 to 8 ranks: say so, rather than list 2-rank meshes "times --cp 3".
    (8, ["--dp", "2", "--cp", "3"], "--cp 3 does not divide 8; valid --cp values: 1, 2, 4, 8"),
])
def test_a_mesh_that_is_not_the_world_lists_the_meshes_that_are(world, argv, words):
    with pytest.raises(ConfigError) as e:
        config_from_args(build_parser().parse_args(argv), world_size=world)
    assert words in str(e.value) and f"WORLD_SIZE={world}" in str(e.value)


@pytest.mark.parametrize("flags,words", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--keep-checkpoints", "2"], "--keep-checkpoints needs --checkpoint-dir"),
    (["--async-checkpoint"], "--async-checkpoint needs --checkpoint-dir"),
    (["--checkpoint-dir", "c", "--resume", "--resume-from", "c/step-000001"],
     "--resume and --resume-from are mutually exclusive"),
    (["--steps", "10", "--stop-at-step", "11"], "--stop-at-step 11 must be at most --steps 10"),
    (["--max-bad-steps", "0"], "--max-bad-steps must be a positive number"),
    (["--min-loss-scale", "0"], "--min-loss-scale must be a positive number"),
])
def test_checkpoint_flag_combinations(flags, words):
    with pytest.raises(ConfigError, match=words):
        parse_train_config(flags, world_size=1)


def test_checkpoint_defaults():
    cfg = parse_train_config(["--checkpoint-dir", "c", "--steps", "50", "--stop-at-step", "20"], world_size=1)
    assert (cfg.checkpoint.every, cfg.checkpoint.keep, cfg.checkpoint.resume) == (None, 3, False)
    assert cfg.optim.last_step == 20 and cfg.guard.max_bad_steps == 5 and cfg.guard.min_loss_scale == 1.0


def test_eval_every_zero_turns_validation_off_and_negative_is_refused():
    assert parse_train_config(["--eval-every", "0"], world_size=1).data.eval_every == 0
    with pytest.raises(ConfigError, match="--eval-every must be >= 0"):
        parse_train_config(["--eval-every", "-1"], world_size=1)


def test_packed_documents_across_stages_need_a_torch_whose_stages_take_integer_tensors(monkeypatch):
    """torch 2.11's stages mark every received tensor as requiring gradients, which the documents' integer
    positions cannot: refused before any process group, naming the flags (on 2.13 the same flags run)."""
    import runtime.config
    from compiler.torch_compat import stages_receive_integer_tensors

    argv = ["--pp", "2", "--document-mask", "--eod-token", "10"]
    if stages_receive_integer_tensors():
        assert parse_train_config(argv, world_size=2).data.document_mask
    monkeypatch.setattr(runtime.config, "stages_receive_integer_tensors", lambda: False)
    with pytest.raises(ConfigError, match="--document-mask with --pp 2 needs torch 2.13"):
        parse_train_config(argv, world_size=2)
    assert parse_train_config(argv[2:], world_size=1).data.document_mask  # one stage receives nothing


def test_a_fresh_model_has_a_table_as_long_as_its_window_and_a_longer_window_than_a_models_context_is_refused():
    # From scratch, --seq-len sizes GPT-2's position table (rows past the window would never train, as with
    # Megatron-LM's default max_position_embeddings); an existing model keeps its context (models.with_window).
    assert parse_train_config(["--model", "small", "--seq-len", "128"], world_size=1).model.n_positions == 128
    assert parse_train_config(["--model", "llama3-debug", "--seq-len", "128"], world_size=1).model.context == 128
    cfg = parse_train_config(["--seq-len", "32"], world_size=1)
    too_long = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_len=48))
    with pytest.raises(ConfigError, match="--seq-len 48 is longer than the model's context of 32 positions; "
                                          "valid --seq-len values: 1 to 32"):
        validate(too_long, world_size=1)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "zero-bubble"])
def test_a_split_backward_refuses_compiled_stages_but_takes_any_mtp_depth(schedule):
    """torch's zero-bubble schedules refuse a compiled stage module: refused before any process starts, naming the
    schedules that run one. Two MTP depths run (their stage's backward is not split: compiler/parallelize/stages.py)."""
    argv = ["--pp", "2", "--schedule", schedule, "--layers", "4", "--microbatches", "4"]
    with pytest.raises(ConfigError, match=rf"--compile cannot run with --schedule {schedule}: .*interleaved-1f1b"):
        parse_train_config([*argv, "--compile"], world_size=2)
    assert parse_train_config(["--pp", "2", "--compile"], world_size=2).compile_blocks  # interleaved 1F1B
    assert parse_train_config([*argv, "--mtp-depth", "2"], world_size=2).model.mtp_depth == 2


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "zero-bubble"])
def test_a_split_backward_refuses_zero3(schedule):
    """ZeRO-3's per-micro-batch reduce-scatter and reshard would run between a micro-batch's input and weight passes
    (the weight pass crashed on resharded parameters, or ranks held no gradient at the clip). FSDP without it runs."""
    argv = ["--dp", "2", "--pp", "2", "--schedule", schedule, "--layers", "4", "--microbatches", "4"]
    with pytest.raises(ConfigError, match=rf"--reshard-after-forward \(ZeRO-3\) cannot run with --schedule {schedule}: "
                                          r".*use --schedule .*1f1b.*, or FSDP without --reshard-after-forward"):
        parse_train_config([*argv, "--reshard-after-forward"], world_size=4)
    assert not parse_train_config(argv, world_size=4).plan.reshard_after_forward
    assert parse_train_config(["--dp", "2", "--pp", "2", "--reshard-after-forward"], world_size=4).plan.reshard_after_forward
