"""The long-context limit comparison (runtime/lab/long_context_limit.py) without launching runs: its --check values,
the parameter counts it names the models by, and its check table's error column."""

from __future__ import annotations

import pytest

from models.gpt_oss.config import matmul_params
from runtime.commands.flags import parse_train_config
from runtime.lab.long_context_limit import check_row, markdown, parameter_count, parse_check
from runtime.lab.study.long_context import COMMON, GPT_OSS_SHAPE


def test_a_check_names_a_known_model_a_cp_degree_and_a_sequence_its_chunks_divide():
    assert parse_check("gpt-oss-debug:4:16384") == ("gpt-oss-debug", 4, 16384)
    for bad in ("gpt-oss-debug:4", "gpt2:2:8192", "gpt-oss-debug:3:8192", "gpt-oss-debug:4:8190", "llama3-debug:x:1"):
        with pytest.raises(ValueError, match="--check"):
            parse_check(bad)


def test_the_gpt_oss_parameter_count_is_its_configs():
    cfg = parse_train_config([*GPT_OSS_SHAPE, *COMMON], world_size=1).model
    # every matrix, sink, router and norm, plus the (untied) embedding table
    assert parameter_count(GPT_OSS_SHAPE) == matmul_params(cfg, activated=False) + cfg.vocab_size * cfg.d_model


def test_the_check_table_gives_the_models_error_against_the_measured_peak():
    gib = 2**30
    run = {"model": "gpt-oss-debug", "cp": 2, "seq_len": 16384, "ac": "selective", "ok": True, "command": "torchrun x",
           "summary": {"peak_tensor_bytes": 0.5 * gib, "predicted_peak_tensor_bytes": 0.45 * gib, "peak_bytes": 1 * gib,
                       "step_times": [30.0]}}
    row = check_row(run)
    assert row["node_bytes"] == 8 * gib
    limits = {"gpt-oss-debug": [{"cp": 8, "none": 212992, "selective": 262144}]}
    lines = markdown(limits, {"gpt-oss-debug": 931120}, [row, check_row({**run, "ok": False})])
    assert "| 8 | 212,992 | 262,144 |" in lines
    assert "| gpt-oss-debug | 2 | 16,384 | selective | 512.0 | 460.8 | -10.0% | 1024 | 8.00 | 30.0 |" in lines
    assert any(line.startswith("| gpt-oss-debug | 2 | 16,384 | selective | failed |") for line in lines)
