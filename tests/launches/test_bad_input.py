"""Bad input: a one-line error naming the flag and the valid values, a non-zero exit within seconds,
and no rank left running.

Every case's message is checked in-process through ``check_inputs`` (runtime/commands/train.py) (the function every rank
runs before any process group exists); the cases in ``THROUGH_TORCHRUN`` also run end to end on
real ranks (exit code, exactly one error line, no traceback, no rank left behind). All cases share
that one code path, so a few end-to-end launches cover its process behaviour; each launch costs
~6 s of torch imports on this machine.
"""

from __future__ import annotations

import pytest
import torch

from runtime.commands.train import InputError, check_inputs
from runtime.distributed.process_group import LaunchEnv
from tests.launch import check_clean_failure

TINY = ["--model", "tiny", "--steps", "1"]

CASES = {
    # name: (nproc, flags, words the error line must contain)
    "mesh-not-world-size": (2, ["--dp", "2", "--pp", "2", "--mp", "2"], ["--dp 2 x --pp 2 x --mp 2", "WORLD_SIZE=2", "1x1x2"]),
    "non-positive-size": (2, ["--dp", "0", "--pp", "2"], ["--dp", "positive"]),
    "negative-size": (2, ["--mp", "-2", "--dp", "-1"], ["--dp", "positive"]),
    "indivisible-heads": (2, ["--mp", "2", "--heads", "3", "--d-model", "96"], ["--mp 2", "--heads 3",
                                                                                "valid --mp values: 1, 3"]),
    "indivisible-width": (2, ["--mp", "2", "--d-model", "63", "--heads", "7"], ["--mp 2", "--d-model 63", "valid --mp values"]),
    "indivisible-mlp": (2, ["--mp", "2", "--mlp-width", "101"], ["--mp 2", "--mlp-width 101", "valid --mp values: 1, 101"]),
    "indivisible-batch": (2, ["--dp", "2", "--global-batch-size", "10", "--micro-batch-size", "4"],
                          ["--global-batch-size 10", "--micro-batch-size 4", "--dp 2"]),
    "batch-mismatch": (2, ["--dp", "2", "--global-batch-size", "16", "--micro-batch-size", "4", "--microbatches", "4"],
                       ["--global-batch-size 16", "must equal", "= 32"]),
    "too-few-layers": (2, ["--pp", "2", "--layers", "3"], ["--layers 3", "--pp 2", "--stages-per-rank 2", "at least 4"]),
    "too-few-microbatches-1f1b": (2, ["--pp", "2", "--schedule", "1f1b", "--microbatches", "1"],
                                  ["--microbatches 1", "1f1b", ">= 2"]),
    "microbatches-not-multiple": (2, ["--pp", "2", "--microbatches", "3"], ["--microbatches 3", "multiple of --pp 2"]),
    "unknown-schedule": (2, ["--dp", "2", "--schedule", "pipedream"], ["--schedule", "interleaved-1f1b", "naive"]),
    "unknown-precision": (2, ["--dp", "2", "--precision", "fp8"], ["--precision", "fp16", "bf16", "fp32"]),
    "unknown-core-binding": (2, ["--dp", "2", "--bind-cores", "numa"], ["--bind-cores", "none", "cost"]),
    "unknown-model": (2, ["--dp", "2", "--model", "huge"], ["--model", "tiny", "small", "medium", "large"]),
    "missing-data-path": (2, ["--dp", "2", "--data", "/nonexistent/corpus.txt"], ["--data /nonexistent/corpus.txt", "builtin"]),
    "eod-token-outside-vocabulary": (2, ["--dp", "2", "--eod-token", "256"], ["--eod-token 256", "[0, 256)"]),
    "document-mask-without-boundaries": (2, ["--dp", "2", "--document-mask"], ["--document-mask", "--eod-token", "Megatron"]),
    "no-loss-across-documents-without-eod": (2, ["--dp", "2", "--no-loss-across-documents"],
                                             ["--no-loss-across-documents", "--eod-token"]),
    "unknown-token-dtype": (2, ["--dp", "2", "--token-dtype", "float16"], ["--token-dtype", "uint16", "uint32"]),
    "bad-mixture-weight": (2, ["--dp", "2", "--data", "0.7:a.bin,b.bin"], ["--data 0.7:a.bin,b.bin", "WEIGHT:PATH"]),
    "v-with-single-stage-schedule": (2, ["--pp", "2", "--schedule", "gpipe", "--stages-per-rank", "2"],
                                     ["--stages-per-rank must be 1", "gpipe"]),
    "v-schedule-without-pipeline": (2, ["--dp", "2", "--schedule", "zbv"], ["--schedule zbv", "--pp >= 2", "--pp 1"]),
    "v-schedule-with-three-stages": (2, ["--pp", "2", "--schedule", "zbv", "--stages-per-rank", "3", "--layers", "6"],
                                     ["--schedule zbv", "--stages-per-rank must be 2", "got 3"]),
    "dualpipev-too-few-microbatches": (2, ["--pp", "2", "--schedule", "dualpipev", "--microbatches", "2"],
                                       ["--microbatches 2", "dualpipev", ">= 4"]),
    "compile-with-split-backward": (2, ["--pp", "2", "--schedule", "zbv", "--compile"],
                                    ["--compile", "--schedule zbv", "1f1b", "looped-bfs"]),
    "non-positive-collective-timeout": (2, ["--dp", "2", "--collective-timeout", "0"],
                                        ["--collective-timeout", "positive number of seconds"]),
    "non-positive-startup-timeout": (2, ["--dp", "2", "--startup-timeout", "0"], ["--startup-timeout", "positive"]),
    "negative-checkpoint-timeout": (2, ["--dp", "2", "--checkpoint-timeout", "-5"], ["--checkpoint-timeout", "positive"]),
    "checkpoint-every-without-dir": (2, ["--dp", "2", "--checkpoint-every", "5"], ["--checkpoint-every", "--checkpoint-dir"]),
    "missing-resume-path": (2, ["--dp", "2", "--resume-from", "/nonexistent/step-000010"],
                            ["--resume-from /nonexistent/step-000010", "no such checkpoint folder"]),
    "auto-with-mesh-flags": (2, ["--auto", "--dp", "2"], ["--auto chooses", "drop --dp or drop --auto"]),
    "dp-shard-not-divisor": (2, ["--dp", "2", "--dp-shard", "3"], ["--dp-shard 3", "--dp 2", "valid --dp-shard values: 1, 2"]),
    "dp-shard-non-positive": (2, ["--dp", "2", "--dp-shard", "0"], ["--dp-shard", "positive"]),
    "zero3-without-dp": (2, ["--pp", "2", "--reshard-after-forward"], ["--reshard-after-forward", "--dp > 1"]),
    "zero3-with-replicate": (2, ["--dp", "2", "--dp-shard", "1", "--reshard-after-forward"],
                             ["--reshard-after-forward", "--dp-shard 1", "--dp-shard > 1"]),
    "unknown-device": (2, ["--dp", "2", "--device", "tpu"], ["--device", "auto", "cpu", "cuda"]),
    "negative-mtp-depth": (2, ["--dp", "2", "--mtp-depth", "-1"], ["--mtp-depth", ">= 0", "got -1"]),
    "mtp-depth-past-the-window": (2, ["--dp", "2", "--seq-len", "8", "--mtp-depth", "8"],
                                  ["--mtp-depth 8 with --seq-len 8", "valid --mtp-depth values: 0 to 7"]),
    "negative-mtp-loss-weight": (2, ["--dp", "2", "--mtp-depth", "1", "--mtp-loss-weight", "-0.3"],
                                 ["--mtp-loss-weight", ">= 0", "got -0.3"]),
    "unknown-reduce-dtype": (2, ["--dp", "2", "--reduce-dtype", "fp8"], ["--reduce-dtype", "fp32", "bf16", "fp16"]),
    # We run as root, which ignores permissions; nobody can create a folder inside /proc.
    "unwritable-checkpoint-dir": (2, ["--dp", "2", "--checkpoint-dir", "/proc/engine-checkpoints"],
                                  ["--checkpoint-dir /proc/engine-checkpoints", "cannot write there"]),
}
if not torch.cuda.is_available():  # asking for CUDA where there is none (tests/runtime/test_device.py fakes a GPU machine)
    CASES["cuda-without-a-gpu"] = (2, ["--dp", "2", "--device", "cuda"], ["--device cuda", "no cuda device", "--device cpu"])


# One per kind of check (flags, data, checkpoint folders, --auto's planner): each raises a different error type.
THROUGH_TORCHRUN = ["mesh-not-world-size", "missing-data-path", "missing-resume-path", "auto-with-mesh-flags"]


def error_line(nproc: int, flags: list[str]) -> str:
    """The line rank 0 prints for ``flags`` on ``nproc`` ranks (fails if the input is accepted)."""
    env = LaunchEnv(rank=0, world_size=nproc, local_rank=0, local_world_size=nproc)
    with pytest.raises(InputError) as raised:
        check_inputs(flags, env)
    line = f"error: {raised.value}"
    assert "\n" not in line, f"not one line: {line!r}"
    return line


@pytest.mark.parametrize("name", list(CASES))
def test_bad_flag_message(name):
    nproc, flags, words = CASES[name]
    line = error_line(nproc, [*TINY, *flags])
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


@pytest.mark.slow
@pytest.mark.parametrize("name", THROUGH_TORCHRUN)
def test_bad_flag_ends_every_rank(name):
    nproc, flags, words = CASES[name]
    check_clean_failure(nproc, [*TINY, *flags], words)


def test_data_with_fewer_tokens_than_one_sequence(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("far too short for a sequence of 64 tokens\n")
    line = error_line(2, [*TINY, "--dp", "2", "--data", str(short)])
    assert f"--data {short}" in line and "fewer than one sequence" in line, line


def test_a_folder_whose_mtp_tensors_do_not_match_its_config(tmp_path):
    """DeepSeek-V3's config names one MTP depth; the folder holds its projection and norms but not its block."""
    import math
    import shutil

    from tests.hf_reference import pack, parse_safetensors, write_safetensors
    from tests.paths import FIXTURE_ROOT

    fixture = FIXTURE_ROOT / "hf-models" / "deepseek-v3"
    shutil.copy(fixture / "config.json", tmp_path / "config.json")
    _, _, tensors = parse_safetensors(fixture / "model.safetensors")
    part = {"model.layers.3.eh_proj.weight": ("F32", [48, 96], pack("F32", [0.0] * math.prod([48, 96])))}
    write_safetensors(tmp_path / "model.safetensors", {**tensors, **part})
    line = error_line(1, ["--init-from", str(tmp_path), "--steps", "1"])
    assert "multi-token-prediction depth 1 (model.layers.3.*) has 1 of its" in line and "num_nextn_predict_layers 1" in line
