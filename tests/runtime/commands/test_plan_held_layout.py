"""``run.py plan`` with a layout past the search's bounds (``--cp`` above the default ``max_cp``, ``--mp`` beyond a
node): the best plans are searched in a space that holds the priced layout, so the best is never slower than it."""

from __future__ import annotations

import json

from compiler.planner.cluster import PRESET_DIR
from runtime.commands import plan as plan_command


def test_a_cp_given_on_this_machine_is_in_the_space_the_best_plans_come_from(tmp_path):
    cluster = tmp_path / "cluster.json"  # a file of its own: planning for that machine, no CPU identity check
    cluster.write_text((PRESET_DIR / "cpu-2core.json").read_text())
    every, best = tmp_path / "all.json", tmp_path / "best.json"
    argv = ["--world", "4", "--model", "tiny", "--cluster", str(cluster), "--precisions", "fp32", "--global-batch-size",
            "16", "--cp", "2", "--out", str(every), "--json", str(best)]
    assert plan_command.main(argv) == 0
    assert {p["plan"]["cp"] for p in json.loads(every.read_text())["plans"]} == {1, 2}
    data = json.loads(best.read_text())
    assert data["priced"]["cp"] == 2 and data["best"]["step_time_s"] <= data["priced"]["step_time_s"]


def test_an_mp_beyond_a_node_is_priced_and_searched(tmp_path, run_main):
    out = tmp_path / "best.json"
    argv = ["--world", "16", "--cluster", "h100-80gb", "--model", "llama3-8b", "--global-batch-size", "16",
            "--kv-heads", "16", "--mp", "16", "--json", out]
    code, printed, err = run_main(plan_command.main, argv)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["priced"]["mp"] == 16 and data["best"]["step_time_s"] <= data["priced"]["step_time_s"]
