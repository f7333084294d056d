"""``run.py export``'s own lines: a bad flag is one ``error:`` line naming it, checked before any checkpoint is read
(argparse's usage block is not printed), and what the export printed after writing a folder names the files it
wrote."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from models import build_model, config_to_dict, named_config
from runtime.commands import export
from tests.paths import FIXTURE_ROOT


@pytest.mark.parametrize(("flags", "line"), [
    (["--format", "bogus"], "error: argument --format: invalid choice: 'bogus' (choose from 'pt', 'hf', 'gpt2', 'peft') "
                            "(see run.py export --help)"),
    (["--export-dtype", "fp8-blocks"], "error: --export-dtype fp8-blocks applies to --format hf; --format pt writes the "
                                       "checkpoint's fp32 tensors (drop --export-dtype, or use --format hf)"),
    (["--format", "peft", "--dtype", "bf16"], "error: --export-dtype bf16 applies to --format hf; --format peft writes "
                                              "the checkpoint's fp32 tensors (drop --export-dtype, or use --format hf)"),
    (["--format", "hf", "--max-shard-size", "lots"], "error: --max-shard-size 'lots': give a positive size such as 5GB, "
                                                     "500MB or 2GiB"),
])
def test_a_bad_flag_is_one_error_line_before_the_checkpoint_is_read(run_main, tmp_path, flags, line):
    printed = run_main(export.main, ["--checkpoint", tmp_path / "no-such-checkpoint", "--out", tmp_path / "out", *flags])
    assert printed.code == 2 and printed.err.splitlines() == [line], printed.err


def test_the_tokenizer_files_kept_are_named_by_file(run_main, tmp_path, monkeypatch):
    """A checkpoint keeps its run's tokenizer files; the export names them (not the letters of another line)."""
    checkpoint = tmp_path / "step-000003"
    checkpoint.mkdir()
    tokenizer = FIXTURE_ROOT / "tokenizers" / "llama3-style"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (checkpoint / name).write_bytes((tokenizer / name).read_bytes())
    cfg = named_config("tiny")
    weights = {name: p.detach() for name, p in build_model(cfg, seed=0).named_parameters()}
    info = SimpleNamespace(path=checkpoint, files={}, step=3, config={"model": config_to_dict(cfg), "checkpoint": {}})
    monkeypatch.setattr(export, "resolve_checkpoint", lambda path: info)
    monkeypatch.setattr(export, "verify_files", lambda info, files: [])
    monkeypatch.setattr(export, "load_model_weights", lambda info: weights)
    printed = run_main(export.main, ["--checkpoint", checkpoint, "--out", tmp_path / "out", "--format", "hf"])
    assert printed.code == 0, printed.err
    assert ("with the tokenizer the checkpoint keeps: special_tokens_map.json, tokenizer.json, tokenizer_config.json"
            in printed.out.splitlines()), printed.out
