"""Packing conversations into windows (runtime/engine/data/packing.py): best fit decreasing puts every item in
exactly one window, never over capacity, in the window with the least room that holds it; long conversations
are cut or dropped and counted."""

from __future__ import annotations

import random

import pytest

from runtime.engine.data.packing import best_fit_decreasing, fit_to_window, one_per_window


def _fills_by_search(lengths: list[int], capacity: int) -> list[int]:
    """The rule written out, as each window's tokens: items longest first, each into the window with the least
    room that holds it, else a new one. (Which of several windows with equal room takes an item changes no
    window's fill: one room r becomes r - length either way.)"""
    fills: list[int] = []
    for n in sorted(lengths, reverse=True):
        fitting = [k for k, fill in enumerate(fills) if capacity - fill >= n]
        if fitting:
            fills[max(fitting, key=lambda k: fills[k])] += n
        else:
            fills.append(n)
    return sorted(fills)


@pytest.mark.parametrize("seed", range(5))
def test_every_item_once_within_capacity(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 65) for _ in range(300)]
    windows = best_fit_decreasing(lengths, capacity=65)
    assert sorted(i for w in windows for i in w) == list(range(300))
    assert all(sum(lengths[i] for i in w) <= 65 for w in windows)
    assert len(windows) <= 11 / 9 * sum(lengths) / 65 + 4  # the decreasing rules' bound against a perfect packing


def test_the_window_with_the_least_room_that_fits():
    # capacity 12: 10 opens w0 (room 2), 7 opens w1 (room 5), 5 fills w1, the first 2 fills w0, the last opens w2.
    assert best_fit_decreasing([2, 7, 10, 5, 2], capacity=12) == [[2, 0], [1, 3], [4]]
    # capacity 10: 7 opens w0 (room 3), 5 opens w1 (room 5), 4 goes to w1 (room 1); 1 goes to w1, the window with
    # the least room, where first fit would put it into w0.
    assert best_fit_decreasing([7, 5, 4, 1], capacity=10) == [[0], [1, 2, 3]]
    rng = random.Random(7)
    for _ in range(20):
        lengths = [rng.randint(1, 20) for _ in range(40)]
        windows = best_fit_decreasing(lengths, capacity=20)
        assert sorted(sum(lengths[i] for i in w) for w in windows) == _fills_by_search(lengths, 20)


def test_without_packing_one_conversation_per_window():
    assert one_per_window([5, 3, 9]) == [[0], [1], [2]]


def test_an_item_larger_than_a_window_is_refused():
    with pytest.raises(ValueError, match="a window holds 1 to 8"):
        best_fit_decreasing([3, 9], capacity=8)


def test_long_conversations_truncated_or_dropped():
    truncated = fit_to_window([5, 12, 8, 30], capacity=8, policy="truncate")
    assert (truncated.kept, truncated.truncated, truncated.dropped) == ([5, 8, 8, 8], 2, 0)
    dropped = fit_to_window([5, 12, 8, 30], capacity=8, policy="drop")
    assert (dropped.kept, dropped.truncated, dropped.dropped) == ([5, 0, 8, 0], 0, 2)
    with pytest.raises(ValueError, match="truncate, drop"):
        fit_to_window([5], capacity=8, policy="split")
