"""Schedule arithmetic and the naive stop-and-wait order."""

import pytest

from compiler.naive_schedule import naive_rank_actions
from compiler.schedules import bubble_fraction, ideal_speedup_over_naive, local_stage_indices


def test_bubble_formulas():
    assert bubble_fraction("naive", p=2, m=8, v=1) == pytest.approx(0.5)
    assert bubble_fraction("1f1b", p=4, m=8, v=1) == pytest.approx(3 / 11)
    assert bubble_fraction("gpipe", p=4, m=8, v=1) == bubble_fraction("1f1b", p=4, m=8, v=1)
    assert bubble_fraction("interleaved-1f1b", p=4, m=8, v=2) == pytest.approx(3 / 19)
    assert bubble_fraction("1f1b", p=1, m=8, v=1) == 0.0
    # The bound: interleaved v=2, p=2, m=8 is 1.88x the stop-and-wait loop.
    assert ideal_speedup_over_naive("interleaved-1f1b", p=2, m=8, v=2) == pytest.approx(1.882, abs=1e-3)


def test_naive_runs_one_microbatch_through_all_stages_before_the_next():
    actions = naive_rank_actions(0, pp=2, n_stages=4, n_microbatches=2)
    assert [str(a) for a in actions] == ["0F0", "2F0", "2B0", "0B0", "0F1", "2F1", "2B1", "0B1"]


def test_looped_placement():
    assert local_stage_indices(1, pp=4, stages_per_rank=2) == [1, 5]
