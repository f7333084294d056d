"""runtime/engine/gc_control.py: automatic collection off during training, back on afterwards."""

from __future__ import annotations

import gc

import pytest

from runtime.engine.gc_control import collect_if_due, garbage_collection_between_steps


def test_collection_is_off_inside_and_restored_even_on_error():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with garbage_collection_between_steps():
            assert not gc.isenabled()
            raise RuntimeError("a step failed")
    assert gc.isenabled()


def test_scheduled_collection_frees_cycles_only_when_due():
    class Node:
        pass

    with garbage_collection_between_steps():
        before = gc.get_count()[0]
        for _ in range(1000):
            a, b = Node(), Node()
            a.other, b.other = b, a  # a reference cycle: only the collector frees it
        assert gc.get_count()[0] > before  # nothing collected them automatically
        collect_if_due(3, every=50)
        assert gc.get_count()[0] > before
        collect_if_due(50, every=50)
        assert gc.get_count()[0] < before + 10
