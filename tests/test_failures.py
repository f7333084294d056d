"""The one-line description of a lost or silent peer, and the stop-signal recorder."""

from __future__ import annotations

import os
import signal

from runtime.distributed.failures import describe_peer_failure
from runtime.distributed.mesh import GridLayout
from runtime.engine.preemption import stop_on_signals

LAYOUT = GridLayout(2, 2, 2)


def _raised_in(function_name: str, message: str, *, step: str | None = "step 13") -> RuntimeError:
    """An error raised from inside a function of that name, tagged with a step as the loop tags it."""
    namespace: dict = {}
    exec(f"def {function_name}():\n    raise RuntimeError({message!r})", namespace)
    try:
        namespace[function_name]()
    except RuntimeError as e:
        if step:
            e.add_note(step)
        return e
    raise AssertionError("not raised")


def test_a_timed_out_pipeline_receive_names_the_step_operation_and_pipeline_peers():
    error = _raised_in("step", "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation to complete")
    line = describe_peer_failure(error, rank=2, layout=LAYOUT, timeout_s=30)
    # rank 2 = (dp 0, pp 1, mp 0): its pipeline peer is rank 0
    assert line == ("rank 2: recv timed out after 30 s (--collective-timeout 30) in step 13, during the pipeline "
                    "schedule (activations and gradients with the pipeline peers, TP and FSDP collectives); "
                    "waiting on pipeline peers 0")


def test_a_lost_connection_in_the_step_all_reduce_names_the_world():
    error = _raised_in("_optimizer_step", "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")
    line = describe_peer_failure(error, rank=5, layout=LAYOUT, timeout_s=300)
    assert line.startswith("rank 5: a peer rank closed its connection") and line.endswith("waiting on all 8 ranks")
    assert "in step 13, during the step's all-reduce" in line


def test_a_timeout_wrapped_by_the_pipeline_stage_is_still_recognised():
    # torch.distributed.pipelining's stage_backward re-raises as `RuntimeError(<shapes>) from e`: the
    # timeout is only in the cause.
    def stage_backward():
        try:
            raise RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete")
        except RuntimeError as e:
            raise RuntimeError("Failed to run stage backward: Stage output: ...") from e

    try:
        stage_backward()
    except RuntimeError as e:
        e.add_note("step 4")
        error = e
    line = describe_peer_failure(error, rank=0, layout=LAYOUT, timeout_s=30)
    assert line is not None and line.startswith("rank 0: recv timed out after 30 s (--collective-timeout 30) in step 4")


def test_other_errors_are_left_alone():
    assert describe_peer_failure(_raised_in("step", "CUDA out of memory"), rank=0, layout=LAYOUT, timeout_s=30) is None


def test_a_stop_signal_is_recorded_not_fatal_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with stop_on_signals() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.signal == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before
