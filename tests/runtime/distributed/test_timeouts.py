"""runtime/distributed/timeouts.py: each phase sets every process group's timeout to its own flag's (read back
from the groups' backends, gloo here), exempt groups keep theirs, a phase left normally gives way to the one
before, and an error is tagged with the innermost phase it left. tests/launches/test_hang.py shows each phase's timeout
firing in real jobs."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from compiler.torch_compat import group_timeout
from runtime.distributed.timeouts import CHECKPOINT, STARTUP, STEADY, PhaseTimeouts, Timeouts, noted_phase

TIMEOUTS = Timeouts(startup_s=41, steady_s=7, checkpoint_s=93)
CPU = torch.device("cpu")


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=5))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _seconds(group: dist.ProcessGroup) -> float:
    return group_timeout(group, CPU).total_seconds()


def test_every_group_takes_its_phases_timeout_but_the_exempt_one(world_of_one):
    world = dist.group.WORLD
    phases = PhaseTimeouts(TIMEOUTS)
    mesh_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUTS.startup_s))
    background = phases.exempt(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=93)))
    assert phases.current is STARTUP and _seconds(world) == 41  # the world was made with 5 s
    phases.switch(STEADY)
    assert (_seconds(world), _seconds(mesh_group), _seconds(background)) == (7, 7, 93)
    with phases.during(CHECKPOINT):
        assert phases.current is CHECKPOINT and (_seconds(world), _seconds(mesh_group)) == (93, 93)
    assert phases.current is STEADY and (_seconds(world), _seconds(mesh_group), _seconds(background)) == (7, 7, 93)
    with phases.during(STARTUP):  # the first validation pass
        assert _seconds(mesh_group) == 41
    assert _seconds(mesh_group) == 7


def test_an_error_is_tagged_once_with_the_innermost_phase_it_left():
    phases = PhaseTimeouts(TIMEOUTS)  # no process group: nothing to set, the phases still tracked
    phases.switch(STEADY)
    with pytest.raises(RuntimeError) as raised, phases.noting(), phases.during(CHECKPOINT):
        raise RuntimeError("Timed out waiting 93000ms for recv operation to complete")
    assert raised.value.__notes__ == ["phase: checkpoint I/O"] and noted_phase(raised.value) is CHECKPOINT
    phases.switch(STEADY)
    with pytest.raises(RuntimeError) as raised, phases.noting():
        with phases.during(CHECKPOINT):
            pass
        raise RuntimeError("Timed out waiting 7000ms for recv operation to complete")
    assert noted_phase(raised.value) is STEADY
    with pytest.raises(ValueError) as raised, phases.noting():
        raise ValueError("not a communication error")
    assert noted_phase(raised.value) is None
