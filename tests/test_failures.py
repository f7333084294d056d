"""The one-line description of a lost or silent peer (gloo and NCCL texts), NCCL's error handling, and the
stop-signal recorder."""

from __future__ import annotations

import os
import signal

import torch.distributed as dist

from runtime.distributed.failures import describe_peer_failure
from runtime.distributed.mesh import GridLayout
from runtime.distributed.process_group import nccl_error_handling
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


# --- NCCL: the watchdog's texts (ProcessGroupNCCL.cpp, torch 2.11 and 2.13) arrive as DistBackendError ----

NCCL_TIMEOUT = ("[PG ID 1 PG GUID 3(mesh_pp) Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=41, "
                "OpType=RECV, NumelIn=8192, NumelOut=8192, Timeout(ms)=30000) ran for 30012 milliseconds before timing out.")


def _backend_error_in(function_name: str, message: str) -> dist.DistBackendError:
    namespace: dict = {"DistBackendError": dist.DistBackendError}
    exec(f"def {function_name}():\n    raise DistBackendError({message!r})", namespace)
    try:
        namespace[function_name]()
    except dist.DistBackendError as e:
        e.add_note("step 7")
        return e
    raise AssertionError("not raised")


def test_an_nccl_watchdog_timeout_in_the_pipeline_names_the_operation_and_peers():
    line = describe_peer_failure(_backend_error_in("step", NCCL_TIMEOUT), rank=2, layout=LAYOUT, timeout_s=30)
    assert line == ("rank 2: recv timed out after 30 s (--collective-timeout 30) in step 7, during the pipeline "
                    "schedule (activations and gradients with the pipeline peers, TP and FSDP collectives); "
                    "waiting on pipeline peers 0")


def test_an_aborted_nccl_communicator_reports_the_timeout_that_aborted_it():
    aborted = ("NCCL communicator was aborted on rank 5.  Original reason for failure was: "
               + NCCL_TIMEOUT.replace("OpType=RECV", "OpType=ALLREDUCE"))
    line = describe_peer_failure(_backend_error_in("_optimizer_step", aborted), rank=5, layout=LAYOUT, timeout_s=30)
    assert line.startswith("rank 5: all-reduce timed out after 30 s (--collective-timeout 30) in step 7, during the "
                           "step's all-reduce") and line.endswith("waiting on all 8 ranks")


def test_an_nccl_peer_that_exited_is_a_lost_peer():
    remote = ("NCCL error in: ProcessGroupNCCL.cpp:2142, remote process exited or there was a network error, NCCL "
              "version 2.27.3\nncclRemoteError: A call failed possibly due to a network error or a remote process "
              "exiting prematurely.")
    line = describe_peer_failure(_backend_error_in("finish", remote), rank=4, layout=LAYOUT, timeout_s=300)
    assert line.startswith("rank 4: a peer rank closed its connection") and line.endswith("waiting on replica peers 0")


def test_any_other_backend_error_is_one_line_naming_the_backends_message():
    line = describe_peer_failure(_backend_error_in("step", "NCCL error in: ProcessGroupNCCL.cpp:77, unhandled system "
                                                           "error\nLast error:\nsocket"), rank=0, layout=LAYOUT, timeout_s=30)
    assert line.startswith("rank 0: the communication backend failed (NCCL error in: ProcessGroupNCCL.cpp:77, "
                           "unhandled system error) in step 7")
    assert "\n" not in line


def test_nccl_error_handling_lets_the_process_live_unless_the_user_chose():
    environ: dict[str, str] = {}
    assert nccl_error_handling(environ) == "2" and environ == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        chosen = {name: "3"}
        assert nccl_error_handling(chosen) == "3" and chosen == {name: "3"}
