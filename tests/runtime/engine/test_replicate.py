"""Replicated data parallelism's buckets, as rank 0 of a pretended two-rank world (collectives answer at once
without moving data; each all-reduce's input is recorded): buckets go out in bucket order whatever order
their gradients finish in, each rank's share is divided before the sum, and the weight passes of
split-backward schedules, which fire no accumulate hook, launch the buckets during the schedule (an empty one,
whose input pass the hooks reported, counts nothing)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import runtime.engine.replicate as replicate
from compiler.torch_compat import backward_whole_in_input_pass
from runtime.engine.replicate import ReplicatedGradients
from tests.fake_world import fake_world


@pytest.fixture
def two_ranks(monkeypatch):
    """Rank 0 of 2; returns the list every all-reduce's input (a copy) is appended to."""
    sent: list[torch.Tensor] = []
    with fake_world(rank=0, world_size=2):
        real = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: sent.append(t.clone()) or real(t, *a, **k))
        monkeypatch.setattr(replicate, "BUCKET_BYTES", 8)  # one bucket per 2-element parameter
        yield sent


def _params(n: int) -> list[torch.nn.Parameter]:
    """Parameter i holds [i, i] and its gradient [10 (i + 1), 10 (i + 1)]."""
    params = [torch.nn.Parameter(torch.full((2,), float(i))) for i in range(n)]
    for i, p in enumerate(params):
        p.grad = torch.full((2,), 10.0 * (i + 1))
    return params


def test_buckets_launch_in_bucket_order_and_each_share_is_divided_first(two_ranks):
    a, b, c, d = params = _params(4)
    grads = ReplicatedGradients(params, group=dist.group.WORLD, reduce_dtype=None, accumulations=1)
    assert grads.buckets == [[d], [c], [b], [a]]  # reverse order: backward produces the last layers first
    for ready in (b, a):  # finished out of order: they wait for the buckets before them
        grads._on_accumulated(ready)
    assert two_ranks == []
    grads._on_accumulated(d)
    assert [t.tolist() for t in two_ranks] == [[20.0, 20.0]]  # d's 40 / 2 ranks, before the sum
    grads._on_accumulated(c)
    assert [t.tolist() for t in two_ranks] == [[20.0, 20.0], [15.0, 15.0], [10.0, 10.0], [5.0, 5.0]]
    grads.finish()
    assert len(two_ranks) == 4 and a.grad.tolist() == [5.0, 5.0]  # the (pretended) sum of the halves


class _SplitStage:
    """A stage whose weight pass adds to .grad itself (a split schedule's torch.autograd.grad), or, as the
    first stage does, runs a backward that reports each accumulation through the hooks."""

    def __init__(self, params: list[torch.nn.Parameter], *, reports: ReplicatedGradients | None = None):
        self.submod = torch.nn.ParameterList(params)
        self.reports = reports

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        for p in self.submod:
            p.grad += 1.0
            if self.reports is not None:
                self.reports._on_accumulated(p)



def test_weight_passes_of_split_schedules_launch_buckets_before_the_step_ends(two_ranks):
    a, b, c, d = params = _params(4)
    split, hooked = _SplitStage([a, b]), _SplitStage([c, d])
    grads = ReplicatedGradients(params, group=dist.group.WORLD, reduce_dtype=None, accumulations=2,
                                stages=[split, hooked])
    hooked.reports = grads
    for microbatch in range(2):
        hooked.backward_weight_one_chunk(microbatch)
        split.backward_weight_one_chunk(microbatch)
    # Every bucket went out during the schedule, once each, with both micro-batches' gradients: (10 (i + 1) + 2) / 2.
    assert [t.tolist() for t in two_ranks] == [[21.0, 21.0], [16.0, 16.0], [11.0, 11.0], [6.0, 6.0]]
    grads.finish()
    assert len(two_ranks) == 4


class _WholeBackwardStage:
    """The last stage with two MTP depths: its input pass runs the whole backward (the hooks report it) and its
    weight pass is empty (compiler/torch_compat.py ``backward_whole_in_input_pass``)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.submod = torch.nn.ParameterList(params)
        self.dw_builder = None
        backward_whole_in_input_pass(self)

    def input_pass(self, reports: ReplicatedGradients) -> None:
        for p in self.submod:
            p.grad += 1.0
            reports._on_accumulated(p)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        self.dw_builder()()


def test_an_empty_weight_pass_is_not_counted_as_an_accumulation(two_ranks):
    (a,) = params = _params(1)
    stage = _WholeBackwardStage(params)
    grads = ReplicatedGradients(params, group=dist.group.WORLD, reduce_dtype=None, accumulations=2, stages=[stage])
    stage.input_pass(grads)
    stage.backward_weight_one_chunk(0)
    assert two_ranks == []  # one micro-batch of two: counting the empty W would launch a's bucket now
    stage.input_pass(grads)
    stage.backward_weight_one_chunk(1)
    assert [t.tolist() for t in two_ranks] == [[6.0, 6.0]]  # (10 + 2) / 2: both micro-batches, once
