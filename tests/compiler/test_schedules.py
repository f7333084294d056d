"""Schedule arithmetic and the naive stop-and-wait order."""

from types import SimpleNamespace

import pytest

from compiler.naive_schedule import naive_rank_actions
from compiler.schedules import SCHEDULES, bubble_fraction, ideal_speedup_over_naive
from compiler.torch_compat import ComputationType, generate_stage_to_rank_mapping


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
    assert SCHEDULES["interleaved-1f1b"].stage_indices(1, pp=4, stages_per_rank=2) == [1, 5]


@pytest.mark.parametrize("name", [n for n, s in SCHEDULES.items() if s.multi_stage])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_placement_is_the_one_torch_schedules_with(name, pp):
    """Our stage -> rank map must be torch's, or stages would send activations to the wrong rank."""
    spec = SCHEDULES[name]
    v = spec.fixed_v or 2
    style = "v" if spec.placement == "v" else "loop"
    torch_owner = generate_stage_to_rank_mapping(pp, pp * v, style=style)
    assert {s: spec.stage_owner(s, pp=pp, stages_per_rank=v) for s in range(pp * v)} == torch_owner
    if spec.placement == "v":  # rank 0 holds the first and the last stage
        assert spec.stage_indices(0, pp=pp, stages_per_rank=2) == [0, 2 * pp - 1]


def _torch_actions(cls, *, p: int, m: int, rank: int, v: int = 2):
    """The compute actions torch's schedule class plans for ``rank`` (its own planner, without stages)."""
    fields = SimpleNamespace(pp_group_size=p, _n_microbatches=m, n_local_stages=v, num_stages=p * v,
                             _num_stages=p * v, rank=rank, _stages=[None] * v, stage_index_to_group_rank={})
    return [a for a in cls._calculate_single_rank_operations(fields, rank) if a is not None]


def _peak_held(actions) -> int:
    """Most stage-micro-batches whose forward ran and whose input-gradient backward has not."""
    held = peak = 0
    flat = [sub for a in actions for sub in (a.sub_actions or (a,))]
    for a in flat:
        if a.computation_type == ComputationType.FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.computation_type in (ComputationType.BACKWARD_INPUT, ComputationType.FULL_BACKWARD):
            held -= 1
    return peak


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "looped-bfs"])
@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_in_flight_formulas_bound_what_torch_schedules(name, p, m):
    """The memory model's micro-batches in flight for the new schedules, against torch's own action lists:
    never below what any rank holds, and at most one above."""
    spec = SCHEDULES[name]
    for rank in range(p):
        held = _peak_held(_torch_actions(spec.torch_class, p=p, m=m, rank=rank))
        predicted = spec.stage_microbatches_in_flight(p=p, m=m, v=2, rank=rank)
        assert held <= predicted <= held + 1, (rank, held, predicted)


def test_new_schedule_bubbles():
    # Looped BFS idles like interleaved; the zero-bubble V schedules' ideal is no bubble (F = B = W).
    assert bubble_fraction("looped-bfs", p=4, m=8, v=2) == bubble_fraction("interleaved-1f1b", p=4, m=8, v=2)
    assert bubble_fraction("zbv", p=2, m=8, v=2) == 0.0 == bubble_fraction("dualpipev", p=2, m=8, v=2)
    assert ideal_speedup_over_naive("zbv", p=2, m=8, v=2) == pytest.approx(2.0)


def test_the_forward_only_pass_runs_every_stage_once_per_microbatch_and_pairs_its_messages():
    from torch.distributed.pipelining.schedules import _ComputationType as C

    from compiler.naive_schedule import forward_only_actions

    for placement, v in (("v", 2), ("loop", 2), ("loop", 1)):
        for pp in (2, 3, 4):
            order = forward_only_actions(pp=pp, stages_per_rank=v, n_microbatches=3, placement=placement)
            forwards = sorted((a.stage_index, a.microbatch_index) for acts in order.values() for a in acts
                              if a.computation_type == C.FORWARD)
            assert forwards == [(s, mb) for s in range(pp * v) for mb in range(3)]
            sends = sorted((a.stage_index + 1, a.microbatch_index) for acts in order.values() for a in acts
                           if a.computation_type == C.SEND_F)
            recvs = sorted((a.stage_index, a.microbatch_index) for acts in order.values() for a in acts
                           if a.computation_type == C.RECV_F)
            assert sends == recvs  # every message sent is received, by the next stage
            for acts in order.values():  # a stage receives before it computes and computes before it sends
                seen = [(a.computation_type, a.stage_index, a.microbatch_index) for a in acts]
                for kind, s, mb in seen:
                    if kind == C.RECV_F:
                        assert seen.index((kind, s, mb)) < seen.index((C.FORWARD, s, mb))
                    if kind == C.SEND_F:
                        assert seen.index((C.FORWARD, s, mb)) < seen.index((kind, s, mb))
