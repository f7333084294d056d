"""The MTP overhead benchmark (runtime/lab/mtp_overhead.py) runs both engines in one process and reports its pairs and
the planner's price; the speed itself is never asserted."""

from __future__ import annotations

import json

import pytest

from runtime.lab import mtp_overhead


@pytest.mark.slow  # two engines built and stepped
def test_it_reports_paired_steps_and_the_planners_price(capsys):
    assert mtp_overhead.main(["--pairs", "2", "--warmup", "1", "--model-flags",
                              "--model llama3-debug --layers 2 --seq-len 32"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["pairs"] == 2 and set(report["step_s"]) == {"0", "1"} and report["overhead"] > 0
    assert report["planner_overhead"] > 1  # a depth adds a block, a projection and the head to every step
