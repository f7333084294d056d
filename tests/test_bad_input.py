"""Bad input: a one-line error naming the flag and the valid values, a non-zero exit within seconds,
and no rank left running. Each case runs through torchrun with real ranks."""

from __future__ import annotations

import time

import pytest

from tests.launch import ROOT, torchrun

TINY = ["--model", "tiny", "--steps", "1"]

CASES = {
    # name: (nproc, flags, words the error line must contain)
    "mesh-not-world-size": (2, ["--dp", "2", "--pp", "2", "--mp", "2"], ["--dp 2 x --pp 2 x --mp 2", "WORLD_SIZE=2", "1x1x2"]),
    "non-positive-size": (2, ["--dp", "0", "--pp", "2"], ["--dp", "positive"]),
    "negative-size": (2, ["--mp", "-2", "--dp", "-1"], ["--dp", "positive"]),
    "indivisible-heads": (2, ["--mp", "2", "--heads", "3", "--d-model", "96"], ["--mp 2", "--heads 3", "valid --mp values: 1, 3"]),
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
    "unknown-model": (2, ["--dp", "2", "--model", "huge"], ["--model", "tiny", "small", "medium", "large"]),
    "missing-data-path": (2, ["--dp", "2", "--data", "/nonexistent/corpus.txt"], ["--data /nonexistent/corpus.txt", "builtin"]),
    "v-with-single-stage-schedule": (2, ["--pp", "2", "--schedule", "gpipe", "--stages-per-rank", "2"],
                                     ["--stages-per-rank must be 1", "gpipe"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_flag(name):
    nproc, flags, words = CASES[name]
    _check_clean_failure(nproc, [*TINY, *flags], words)


def test_data_with_fewer_tokens_than_one_sequence(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("far too short for a sequence of 64 tokens\n")
    _check_clean_failure(2, [*TINY, "--dp", "2", "--data", str(short)], [f"--data {short}", "fewer than one sequence"])


def _check_clean_failure(nproc: int, flags: list[str], words: list[str]) -> None:
    start = time.monotonic()
    result = torchrun(flags, nproc=nproc, timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    ours = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert len(ours) == 1, f"expected exactly one error line, got {ours}\n{result.stderr[-2000:]}"
    for word in words:
        assert word in ours[0], f"{word!r} not in {ours[0]!r}"
    # torchrun adds its own failure report; no rank may crash with a traceback through our code.
    for ours_path in ("run.py", "runtime/", "compiler/", "models/"):
        assert f'File "{ROOT / ours_path}' not in result.stdout + result.stderr
    assert elapsed < 45, f"took {elapsed:.0f}s to fail"
