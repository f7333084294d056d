"""The batch search finds the largest fitting micro-batch with few trials."""

import pytest

from runtime.lab.study.memory_search import search_max_batch


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 64, 100, 1000])
def test_finds_the_exact_boundary(limit):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= limit

    result = search_max_batch(fits)
    assert result.max_fitting == limit and result.first_failing == limit + 1
    assert len(calls) <= 2 * limit.bit_length() + 2  # doubling then bisection, not a linear scan
    assert all(ok == (b <= limit) for b, ok in result.trials)


def test_resolution_stops_early_but_never_overstates():
    result = search_max_batch(lambda b: b <= 100, resolution=0.25)
    assert 75 <= result.max_fitting <= 100 and result.first_failing > 100
    assert result.first_failing - result.max_fitting <= 0.25 * result.max_fitting


def test_nothing_fits_and_cap():
    assert search_max_batch(lambda b: False).max_fitting == 0
    capped = search_max_batch(lambda b: True, cap=256)
    assert capped.max_fitting == 256 and capped.first_failing is None


@pytest.mark.parametrize("limit", [0, 1, 3, 5, 9])
def test_starting_above_one_still_finds_the_boundary(limit):
    result = search_max_batch(lambda b: b <= limit, start=4)
    assert result.max_fitting == limit and result.first_failing == limit + 1
