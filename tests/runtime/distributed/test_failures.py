"""The one-line description of a lost or silent peer (gloo and NCCL texts) naming the phase and its timeout
flag, NCCL's refusal of two ranks on one GPU, NCCL's error handling, and the stop-signal recorder."""

from __future__ import annotations

import contextlib
import os
import signal

import torch.distributed as dist

from runtime.distributed.failures import describe_peer_failure, describe_shared_device
from runtime.distributed.mesh import GridLayout
from runtime.distributed.process_group import nccl_error_handling
from runtime.distributed.timeouts import CHECKPOINT, STARTUP, STEADY, PhaseTimeouts, Timeouts
from runtime.engine.preemption import stop_on_signals

LAYOUT = GridLayout(2, 2, 2)
TIMEOUTS = Timeouts(startup_s=600, steady_s=30, checkpoint_s=900)
PIPELINE = ("the pipeline schedule (activations and gradients with the pipeline peers, TP and FSDP collectives); "
            "waiting on pipeline peers 0")


def _tagged(error: RuntimeError, step: str | None, phase) -> RuntimeError:
    """``error`` tagged as the training loop (the step) and PhaseTimeouts (the phase) tag it."""
    if step:
        error.add_note(step)
    with contextlib.suppress(RuntimeError), PhaseTimeouts(TIMEOUTS).during(phase):
        raise error
    return error


def _raised_in(function_name: str, message: str, *, step: str | None = "step 13", phase=STEADY) -> RuntimeError:
    """An error raised from inside a function of that name, tagged with a step and a phase as training tags it."""
    namespace: dict = {}
    exec(f"def {function_name}():\n    raise RuntimeError({message!r})", namespace)
    try:
        namespace[function_name]()
    except RuntimeError as e:
        return _tagged(e, step, phase)
    raise AssertionError("not raised")


def test_a_timed_out_pipeline_receive_names_the_step_operation_and_pipeline_peers():
    error = _raised_in("step",
                       "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation to complete")
    line = describe_peer_failure(error, rank=2, layout=LAYOUT, timeouts=TIMEOUTS)
    # rank 2 = (dp 0, pp 1, mp 0): its pipeline peer is rank 0
    assert line == ("rank 2: recv timed out after 30 s in steady steps (--collective-timeout 30: every later step and "
                    "validation), in step 13, during " + PIPELINE)


def test_a_lost_connection_in_the_step_all_reduce_names_the_world():
    error = _raised_in("_optimizer_step", "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")
    line = describe_peer_failure(error, rank=5, layout=LAYOUT, timeouts=TIMEOUTS)
    assert line.startswith("rank 5: a peer rank closed its connection (it exited or was killed) in steady steps "
                           "(--collective-timeout 30") and line.endswith("waiting on all 8 ranks")
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
        error = _tagged(e, "step 4", STEADY)
    line = describe_peer_failure(error, rank=0, layout=LAYOUT, timeouts=TIMEOUTS)
    assert line is not None and line.startswith("rank 0: recv timed out after 30 s in steady steps (--collective-timeout 30")
    assert "in step 4, during" in line


def test_a_timeout_in_start_up_names_start_up_and_its_flag():
    error = _raised_in("step", "[gloo] Timed out waiting 600000ms for recv operation to complete", step="step 1",
                       phase=STARTUP)
    line = describe_peer_failure(error, rank=2, layout=LAYOUT, timeouts=TIMEOUTS)
    assert line == ("rank 2: recv timed out after 600 s in start-up (--startup-timeout 600: process groups, tracing, "
                    "--compile, the first step and the first validation), in step 1, during " + PIPELINE)


def test_a_timeout_while_building_the_stages_has_no_step():
    error = _raised_in("build_local_stages", "[gloo] Timed out waiting 600000ms for send operation to complete",
                       step=None, phase=STARTUP)
    line = describe_peer_failure(error, rank=3, layout=LAYOUT, timeouts=TIMEOUTS)
    assert line.startswith("rank 3: send timed out after 600 s in start-up (--startup-timeout 600")
    assert line.endswith("), during building the stages (materialising, tensor and data parallelism); waiting on all "
                         "8 ranks"), line


def test_a_timeout_saving_a_checkpoint_names_checkpoint_io_and_its_flag():
    error = _raised_in("begin_save", "[gloo] Timed out waiting 900000ms for recv operation to complete", step="step 4",
                       phase=CHECKPOINT)
    line = describe_peer_failure(error, rank=1, layout=LAYOUT, timeouts=TIMEOUTS)
    assert line == ("rank 1: recv timed out after 900 s in checkpoint I/O (--checkpoint-timeout 900: saving, publishing "
                    "and loading checkpoints), in step 4, during saving a checkpoint; waiting on all 8 ranks")


def test_other_errors_are_left_alone():
    assert describe_peer_failure(_raised_in("step", "CUDA out of memory"), rank=0, layout=LAYOUT, timeouts=TIMEOUTS) is None


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


def _backend_error_in(function_name: str, message: str, *, phase=STEADY) -> dist.DistBackendError:
    namespace: dict = {"DistBackendError": dist.DistBackendError}
    exec(f"def {function_name}():\n    raise DistBackendError({message!r})", namespace)
    try:
        namespace[function_name]()
    except dist.DistBackendError as e:
        return _tagged(e, "step 7", phase)
    raise AssertionError("not raised")


def test_an_nccl_watchdog_timeout_in_the_pipeline_names_the_operation_and_peers():
    line = describe_peer_failure(_backend_error_in("step", NCCL_TIMEOUT), rank=2, layout=LAYOUT, timeouts=TIMEOUTS)
    assert line == ("rank 2: recv timed out after 30 s in steady steps (--collective-timeout 30: every later step and "
                    "validation), in step 7, during " + PIPELINE)


def test_an_aborted_nccl_communicator_reports_the_timeout_that_aborted_it():
    aborted = ("NCCL communicator was aborted on rank 5.  Original reason for failure was: "
               + NCCL_TIMEOUT.replace("OpType=RECV", "OpType=ALLREDUCE"))
    line = describe_peer_failure(_backend_error_in("_optimizer_step", aborted), rank=5, layout=LAYOUT, timeouts=TIMEOUTS)
    assert line.startswith("rank 5: all-reduce timed out after 30 s in steady steps (--collective-timeout 30: every "
                           "later step and validation), in step 7, during the step's all-reduce")
    assert line.endswith("waiting on all 8 ranks")


def test_an_nccl_work_of_start_up_found_timed_out_in_a_steady_step_names_the_start_up_flag():
    # NCCL's watchdog checks each work against the timeout it was created with; the error surfaces at a later
    # wait, here in the steady phase: the flag to raise is the one whose bound fired.
    late = NCCL_TIMEOUT.replace("Timeout(ms)=30000", "Timeout(ms)=600000")
    line = describe_peer_failure(_backend_error_in("step", late), rank=2, layout=LAYOUT, timeouts=TIMEOUTS)
    assert line.startswith("rank 2: recv timed out after 600 s in start-up (--startup-timeout 600: "), line


def test_an_nccl_peer_that_exited_is_a_lost_peer():
    remote = ("NCCL error in: ProcessGroupNCCL.cpp:2142, remote process exited or there was a network error, NCCL "
              "version 2.27.3\nncclRemoteError: A call failed possibly due to a network error or a remote process "
              "exiting prematurely.")
    line = describe_peer_failure(_backend_error_in("finish", remote), rank=4, layout=LAYOUT, timeouts=TIMEOUTS)
    assert line.startswith("rank 4: a peer rank closed its connection") and line.endswith("waiting on replica peers 0")


def test_any_other_backend_error_is_one_line_naming_the_backends_message():
    line = describe_peer_failure(_backend_error_in("step", "NCCL error in: ProcessGroupNCCL.cpp:77, unhandled system "
                                                           "error\nLast error:\nsocket"), rank=0, layout=LAYOUT,
                                 timeouts=TIMEOUTS)
    assert line.startswith("rank 0: the communication backend failed (NCCL error in: ProcessGroupNCCL.cpp:77, "
                           "unhandled system error) in steady steps (--collective-timeout 30: every later step and "
                           "validation), in step 7")
    assert "\n" not in line


def test_nccl_error_handling_lets_the_process_live_unless_the_user_chose():
    environ: dict[str, str] = {}
    assert nccl_error_handling(environ) == "2" and environ == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        chosen = {name: "3"}
        assert nccl_error_handling(chosen) == "3" and chosen == {name: "3"}


# What rank 1 of two raised from init_process_group(device_id=cuda:0) with CUDA_VISIBLE_DEVICES=0 in both processes
# (torch 2.11.0+cu130, NCCL 2.28.9, an H100, 2026-11-26); rank 0's reads "rank 0 and rank 1".
DUPLICATE_GPU = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage (run with "
                 "NCCL_DEBUG=WARN for details), NCCL version 2.28.9\nncclInvalidUsage: This usually reflects invalid "
                 "usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 60")


def test_two_ranks_on_one_gpu_is_one_line_naming_both_ranks_and_the_fix():
    shared = describe_shared_device(dist.DistBackendError(DUPLICATE_GPU), visible_devices="CUDA_VISIBLE_DEVICES=0")
    assert (shared.rank, shared.other) == (1, 0)  # main() prints it on the lower rank only: one line per pair
    line = shared.line
    assert line.startswith("--device cuda: ranks 0 and 1 are on the same GPU (bus id 60), which NCCL refuses: each "
                           "process sees one device (CUDA_VISIBLE_DEVICES=0) but not its own")
    assert "CUDA_VISIBLE_DEVICES per process" in line and "\n" not in line
    assert describe_shared_device(dist.DistBackendError(NCCL_TIMEOUT), visible_devices=None) is None
