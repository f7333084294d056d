"""One line for a rank that stopped hearing from its peers, instead of the backend's traceback.

A stuck or dead rank leaves its peers waiting in a point-to-point transfer or a collective. Every wait is
bounded by the process groups' timeout (``--collective-timeout``). When it fires:

- gloo raises ``RuntimeError: ... Timed out waiting 30000ms for recv operation to complete``, and the ranks
  that were waiting on *those* ranks then see ``Connection closed by peer``;
- NCCL's watchdog thread notices it (ProcessGroupNCCL.cpp, torch 2.11 and 2.13: ``[Rank 3] Watchdog caught
  collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=4, NumelOut=4,
  Timeout(ms)=30000) ran for 30012 milliseconds before timing out.``). With the error handling
  process_group.py selects (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, abort the communicators without tearing
  the process down) Python sees a ``DistBackendError`` carrying that text, from ``Work.wait()`` or from
  the next operation on the aborted communicator (``NCCL communicator was aborted on rank 3.  Original
  reason for failure was: ...``); a peer that exited shows as ``ncclRemoteError``.

``describe_peer_failure`` turns any of these into a line naming the rank, the phase (start-up, steady steps
or checkpoint I/O: runtime/distributed/timeouts.py) and the flag bounding it, the step, the operation, what the
rank was doing (read off the traceback) and the peers it was exchanging with.

``describe_shared_device`` does the same for NCCL refusing two ranks on one GPU when the process group starts
(both processes saw one device each, but the same one).
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass

import torch.distributed as dist

from runtime.distributed.mesh import GridLayout
from runtime.distributed.timeouts import PHASES, STARTUP, Phase, Timeouts, noted_phase

# A rank gave up on its peers (a timeout, or a peer's connection lost): distinct from 1 (a failed save or
# divergence), 2 (bad input) and 75 (preempted).
PEER_FAILURE_EXIT_CODE = 3
_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation")  # gloo: (milliseconds, operation)
_NCCL_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=\d+, OpType=(\w+),"
                           r"[^)]*?Timeout\(ms\)=(\d+)\)")  # (operation, milliseconds)
_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",  # gloo
         "ncclRemoteError", "remote process exited")  # NCCL: a peer's process ended or its link failed
_NCCL_OPS = {"ALLREDUCE": "all-reduce", "ALLGATHER": "all-gather", "_ALLGATHER_BASE": "all-gather",
             "REDUCE_SCATTER": "reduce-scatter", "_REDUCE_SCATTER_BASE": "reduce-scatter", "SEND": "send",
             "RECV": "recv", "COALESCED": "coalesced send/recv", "BROADCAST": "broadcast", "BARRIER": "barrier"}

# (function in the traceback, what the rank was doing, whose ranks it waited on)
_ACTIVITIES = (
    ("load_checkpoint", "loading a checkpoint", "world"),
    ("begin_save", "saving a checkpoint", "world"),
    ("finish_save", "publishing a checkpoint", "world"),
    ("evaluate", "validation through the pipeline", "pp"),
    ("_optimizer_step", "the step's all-reduce of the gradient norm and loss", "world"),
    ("unscale_", "the fp16 overflow vote", "world"),
    ("sync_grads", "summing the tied embedding's gradients", "pp"),
    ("finish", "the replicas' gradient all-reduce", "dp"),
    ("step", "the pipeline schedule (activations and gradients with the pipeline peers, TP and FSDP collectives)", "pp"),
    ("build_local_stages", "building the stages (materialising, tensor and data parallelism)", "world"),
    ("build_mesh", "creating the process groups", "world"),
    ("fsdp_mesh", "creating the process groups", "world"),
)


def describe_peer_failure(error: BaseException, *, rank: int, layout: GridLayout, timeouts: Timeouts) -> str | None:
    """The error line for a lost or silent peer, or None if ``error`` is something else."""
    chain = _chain(error)  # pipelining re-raises a stage's error from it
    text = "\n".join(str(e) for e in chain)
    timeout_ms, operation = _timed_out(text)
    lost = any(s in text for s in _LOST)
    backend_error = next((e for e in chain if isinstance(e, dist.DistBackendError)), None)
    if timeout_ms is None and not lost and backend_error is None:
        return None
    frames = {f.name for f in traceback.extract_tb(error.__traceback__)}
    activity, group = next(((what, g) for name, what, g in _ACTIVITIES if name in frames), ("a collective", "world"))
    step = next((note for note in getattr(error, "__notes__", []) if note.startswith("step ")), None)
    phase = _phase(noted_phase(error) or STARTUP, timeout_ms, timeouts)
    where = f"{phase.name} ({phase.flag} {timeouts.of(phase):g}: {phase.covers})"
    peers = _peers(rank, layout, group)
    if timeout_ms is not None:
        what = f"{operation} timed out after {timeout_ms / 1000:g} s in {where}"
    elif lost:
        what = f"a peer rank closed its connection (it exited or was killed) in {where}"
    else:
        first_line = next((line.strip() for line in str(backend_error).splitlines() if line.strip()), "no message")
        what = f"the communication backend failed ({first_line[:200]}) in {where}"
    return f"rank {rank}: {what}, {'in ' + step + ', ' if step else ''}during {activity}; waiting on {peers}"


def _phase(surfaced: Phase, timeout_ms: int | None, timeouts: Timeouts) -> Phase:
    """The phase whose flag a timeout came from. On NCCL a work keeps the timeout it was created with and its
    failure surfaces at a later wait, possibly in the next phase (a collective of the first step found timed out
    in the second): the bound that fired says which flag to raise. Where several phases share that bound, or
    none has it, the phase the error surfaced in."""
    if timeout_ms is None or abs(timeouts.of(surfaced) * 1000 - timeout_ms) < 1:
        return surfaced
    return next((p for p in PHASES if abs(timeouts.of(p) * 1000 - timeout_ms) < 1), surfaced)


def _timed_out(text: str) -> tuple[int | None, str]:
    """(milliseconds, operation) of a gloo or NCCL timeout in ``text``, or (None, "")."""
    if gloo := _TIMEOUT.search(text):
        return int(gloo.group(1)), gloo.group(2)
    if nccl := _NCCL_TIMEOUT.search(text):
        return int(nccl.group(2)), _NCCL_OPS.get(nccl.group(1), nccl.group(1).strip("_").lower())
    return None, ""


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from (``__cause__``/``__context__``), outermost first."""
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _peers(rank: int, layout: GridLayout, group: str) -> str:
    dp, pp, mp = layout.coordinates(rank)
    if group == "pp" and layout.pp > 1:
        return "pipeline peers " + ", ".join(str(layout.rank(dp, p, mp)) for p in range(layout.pp) if p != pp)
    if group == "dp" and layout.dp > 1:
        return "replica peers " + ", ".join(str(layout.rank(d, pp, mp)) for d in range(layout.dp) if d != dp)
    return f"all {layout.dp * layout.pp * layout.mp} ranks"


_DUPLICATE_GPU = re.compile(r"Duplicate GPU detected : rank (\d+) and rank (\d+) both on CUDA device (\w+)")


@dataclass(frozen=True)
class SharedDevice:
    line: str  # the error line
    rank: int  # this rank
    other: int  # the rank NCCL found on the same GPU


def describe_shared_device(error: BaseException, *, visible_devices: str | None) -> SharedDevice | None:
    """The error line when NCCL refused to start because two ranks are on one GPU (NCCL's init.cc:
    ``Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60``), else None. It happens where the
    launcher showed every process one device, but the same one (runtime/device.py trusts a visible-devices
    variable to be set per process): ``visible_devices`` is that setting."""
    found = next((m for e in _chain(error) if (m := _DUPLICATE_GPU.search(str(e)))), None)
    if found is None:
        return None
    rank, other, bus = int(found.group(1)), int(found.group(2)), found.group(3)
    line = (f"--device cuda: ranks {min(rank, other)} and {max(rank, other)} are on the same GPU (bus id {bus}), which "
            f"NCCL refuses: each process sees one device ({visible_devices or 'no visible-devices variable set'}) but "
            f"not its own; give every process a device of its own (CUDA_VISIBLE_DEVICES per process, e.g. srun "
            f"--gpus-per-task=1), or leave CUDA_VISIBLE_DEVICES unset so that local rank i takes device i")
    return SharedDevice(line, rank, other)
