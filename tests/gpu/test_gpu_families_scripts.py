"""The CPU-runnable parts of tests/gpu/gpu_families.sh (it has not run on a GPU yet): the GPU runs' flags as the
training command reads them, the choice of a block count that fits, the table of a failed run, and the whole script
at the debug sizes on the CPU (DRY_RUN=1), its results read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runtime.commands.flags import parse_train_config
from tests.gpu import gpu_families
from tests.paths import ROOT


def test_the_gpu_runs_train_the_named_blocks_in_bf16_with_the_memory_measured(tmp_path):
    shapes = {}
    for run in gpu_families.RUNS:
        cfg = parse_train_config(gpu_families.train_argv(run, 4, tmp_path, steps=10, dry_run=False), world_size=1)
        assert (cfg.plan.precision, cfg.plan.micro_batch_size, cfg.plan.ac, cfg.optim.steps) == ("bf16", 1, "none", 10)
        assert cfg.metrics.profile_memory and cfg.metrics.peak_tflops is None  # the GPU's datasheet peak
        shapes[run.model] = (cfg.model.family, cfg.model.n_layers, cfg.model.seq_len)
    assert shapes == {"deepseek-v3-16b": ("deepseek_v3", 4, 4096), "gpt-oss-20b": ("gpt_oss", 4, 8192)}
    plan = gpu_families.plan_argv(gpu_families.RUNS[1], 2, tmp_path / "p.json", cluster=None)
    assert plan[:3] == ["plan", "--world", "1"] and "--cluster" not in plan  # on a GPU machine: its GPU's preset
    assert plan[plan.index("--layers") + 1] == "2" and "--chunked-loss" in plan  # as training runs it


def test_the_first_block_count_that_fits_trains():
    fits, too_big = {"fits": True}, {"fits": False}
    assert gpu_families.choose_layers({4: fits, 2: fits}) == 4
    assert gpu_families.choose_layers({4: too_big, 2: fits}) == 2
    assert gpu_families.choose_layers({4: None, 2: too_big}) is None  # a plan that failed, one that does not fit
    assert gpu_families.LAYERS[0] == 4


def test_a_failed_run_keeps_its_row_in_the_table():
    rows = [{"model": "gpt-oss-20b", "layers": 2, "seq_len": 8192, "ok": False, "error": "...\nCUDA out of memory\n"}]
    assert "gpt-oss-20b | 2 | 8192 | failed: CUDA out of memory" in gpu_families.table(rows)
    with pytest.raises(SystemExit):
        gpu_families.parse_args(["out", "--steps", "0"])


@pytest.mark.slow
def test_the_script_runs_the_debug_sizes_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "DRY_RUN": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", "tests/gpu/gpu_families.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "families.json").read_text())
    assert result["dry_run"] and result["steps"] == 2
    rows = {r["model"]: r for r in result["rows"]}
    assert set(rows) == {"deepseek-v3-debug", "gpt-oss-debug"}
    for r in rows.values():
        assert r["ok"] and r["layers"] == 4 and r["seq_len"] == 64, r
        assert r["tokens_per_sec"] > 0 and r["mfu_activated"] > 0 and len(r["losses"]) == 2
        # the planner's memory model and the profiled peak agree to within a few per cent at this size too
        assert 0.5 < r["peak_tensor_over_predicted"] < 1.5, r
        assert r["planner"]["fits"] and r["planner"]["tokens_per_sec"] > 0
    table = (tmp_path / "families.txt").read_text()
    assert table.count("\n") == 4 and "gpt-oss-debug | 4 | 64 |" in table
    assert "== done" in (tmp_path / "log.txt").read_text()
