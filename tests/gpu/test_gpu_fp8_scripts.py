"""The CPU-runnable parts of tests/gpu/gpu_fp8.sh (it has not run on a GPU yet): the scripts' arguments, the
blocks' FLOP count, the results' assembly (steps that left nothing are named, the others kept) and a tiny dry
run of the blocks and of the context-parallel attention on the CPU."""

from __future__ import annotations

import json

import pytest

from models import named_config
from tests.gpu import gpu_cp_attention, gpu_fp8_blocks, gpu_fp8_results


def test_the_blocks_script_refuses_an_unknown_recipe(capsys):
    with pytest.raises(SystemExit):
        gpu_fp8_blocks.parse_args(["out.json", "--recipes", "tensorwise,mxfp8"])
    assert "mxfp8" in capsys.readouterr().err
    assert gpu_fp8_blocks.parse_args(["out.json"]).recipes == "tensorwise,rowwise,blockwise"


def test_the_blocks_flops_are_six_per_parameter_and_token_plus_causal_attention():
    cfg = named_config("llama3-8b", n_layers=4, seq_len=8192)
    block_params = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336  # q k v o, gate up down (Meta's 8B)
    attention = 6 * 8192 * 4096  # per token and layer: half of 12 T q_width
    assert gpu_fp8_blocks.block_flops(cfg) == 4 * 8192 * (6 * block_params + attention)


def test_results_gather_what_ran_and_name_what_did_not(tmp_path):
    (tmp_path / "blocks.json").write_text(json.dumps({"rows": [
        {"fp8": None, "tokens_per_sec": 100.0, "mfu_bf16_peak": 0.4},
        {"fp8": "rowwise", "tokens_per_sec": 150.0, "mfu_bf16_peak": 0.6}]}))
    (tmp_path / "cp_attention.json").write_text(json.dumps(
        {"shape": {"cp": 8}, "rank_0_ms": 30.0, "rank_7_ms": 32.0, "planner": {"attention_ms": 16.0}}))
    (tmp_path / "moe_experts.json").write_text("{not json")  # a step killed mid-write
    assert gpu_fp8_results.main([str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["missing"] == ["step_profile", "moe_experts"]
    head = result["headline"]
    assert head["blocks_rowwise_speedup_over_bf16"] == 1.5 and head["cp_rank_attention_over_price"] == 2.0
    assert gpu_fp8_results.main([]) == 2


def test_a_dry_run_of_the_blocks_and_of_a_cp_ranks_attention(tmp_path):
    blocks = gpu_fp8_blocks.main([str(tmp_path / "b.json"), "--dry-run", "--recipes", "rowwise", "--repeats", "1"])
    assert [r["fp8"] for r in blocks["rows"]] == [None, "rowwise"] and blocks["dry_run"]
    assert all(r["tokens_per_sec"] > 0 and r["planner_ms"] > 0 for r in blocks["rows"])
    cp = gpu_cp_attention.main([str(tmp_path / "cp.json"), "--dry-run", "--repeats", "1"])
    assert cp["rank_0_ms"] > 0 and cp["rank_1_ms"] > 0 and cp["planner"]["kv_all_gather_ms"] > 0
    assert json.loads((tmp_path / "cp.json").read_text())["shape"]["cp"] == 2
