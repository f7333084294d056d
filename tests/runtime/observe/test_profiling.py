"""runtime/observe/profiling.py and profile_report.py: p2p waits charged to the right category whether a batch
comes back as one work per operation (gloo) or as NCCL's one coalesced work; spans that synchronise the
device's stream while profiling (and only then); every rank's profiles gathered to the logging rank alone."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from runtime.observe.profiling import CATEGORIES, Span, StepProfile, StepRecorder, timed_p2p
from tests.launch import spawn_ranks


class FakeWork:
    def __init__(self):
        self.waited = 0

    def wait(self):
        self.waited += 1
        return True


def _ops(*kinds: str) -> list:
    return [SimpleNamespace(op=dist.isend if kind == "send" else dist.irecv) for kind in kinds]


def _post(recorder: StepRecorder, ops: list, works: list) -> list:
    return timed_p2p(recorder)(lambda p2p_ops, desc=None: works)(ops)


def test_one_work_per_operation_charges_receives_to_idle_and_sends_to_p2p():
    recorder = StepRecorder(rank=0)
    recorder.begin_step()
    works = [FakeWork(), FakeWork()]
    for work in _post(recorder, _ops("send", "recv"), works):
        work.wait()
    spans = {(s.category, s.name) for s in recorder.end_step().spans}
    assert spans == {("pp_send_recv", "post p2p"), ("pp_send_recv", "send wait"), ("idle", "recv wait")}
    assert [w.waited for w in works] == [1, 1]


def test_nccls_one_coalesced_work_for_a_batch_is_a_wait_for_the_neighbour():
    recorder = StepRecorder(rank=0)
    recorder.begin_step()
    coalesced = FakeWork()
    timed = _post(recorder, _ops("send", "recv", "recv"), [coalesced])
    assert len(timed) == 1  # what the schedule waits on: still one work
    timed[0].wait()
    sends_only = _post(recorder, _ops("send", "send"), [FakeWork()])
    sends_only[0].wait()
    waits = [(s.category, s.name) for s in recorder.end_step().spans if s.name.endswith("wait")]
    assert waits == [("idle", "send/recv wait"), ("pp_send_recv", "send wait")] and coalesced.waited == 1


def test_spans_synchronise_the_stream_while_profiling_only():
    calls = []
    recorder = StepRecorder(rank=0, sync=lambda: calls.append(len(calls)))
    with recorder.span("forward", "F0"):
        pass
    assert calls == []  # not profiling: no synchronisation, no span
    recorder.begin_step()
    with recorder.span("forward", "F0"):
        with recorder.span("tp_comm", "redistribute"):
            pass
    profile = recorder.end_step()
    assert len(calls) == 6  # the step's start and end, and each span's opening and closing
    assert [s.name for s in profile.spans] == ["redistribute", "F0"]


def _report_from(dst: int, out_dir: str) -> None:
    from runtime.distributed.mesh import GridLayout
    from runtime.observe.metrics import MetricsLogger
    from runtime.observe.profile_report import profile_report

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def no_all_gather(*args, **kwargs):
        raise AssertionError("profiles must not be all-gathered to every rank")

    dist.all_gather_object = no_all_gather
    exclusive = {**dict.fromkeys(CATEGORIES, 0.0), "forward": 0.1 * (rank + 1), "other": 0.1}
    profiles = [StepProfile(rank, 0.1 * (rank + 2), [Span("forward", "F0", 0.0, 0.1 * (rank + 1), 0)], exclusive)]
    logger = MetricsLogger(f"{out_dir}/log", enabled=rank == dst)
    report = profile_report(profiles, layout=GridLayout(1, 3, 1), schedule="1f1b", microbatches=4, stages_per_rank=1,
                            logger=logger, dst=dst)
    logger.close()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_profiles_are_gathered_to_the_logging_rank_alone(tmp_path):
    spawn_ranks(_report_from, world_size=3, args=(1, str(tmp_path)), timeout=120)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert reports[0] is None and reports[2] is None
    assert [row["rank"] for row in reports[1]["per_rank"]] == [0, 1, 2]
    assert [row["forward"] for row in reports[1]["per_rank"]] == pytest.approx([0.1, 0.2, 0.3])
    written = json.loads((tmp_path / "log" / "time_split.json").read_text())
    assert written["per_rank"] == reports[1]["per_rank"]
    assert (tmp_path / "log" / "timeline.json").exists() and (tmp_path / "log" / "timeline.png").exists()
