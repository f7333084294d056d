"""Process-group start-up and tear-down, for torchrun ranks and for a plain ``python run.py``."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass

import torch.distributed as dist

from runtime.device import backend_for

# --collective-timeout's default, the bound in steady steps (start-up and checkpoints have their own:
# runtime/distributed/timeouts.py): minutes of slack over a step of a few seconds on an oversubscribed CPU,
# short enough that a rank stuck on a dead or stopped peer gives up instead of hanging a job for torch's
# default 30 minutes.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


# How NCCL reports a collective past its timeout (ProcessGroupNCCL.hpp's ErrorHandlingMode, torch 2.11 and 2.13).
# Its watchdog thread finds the timed-out work; under torch's default, 3 ("skip clean-up"), it rethrows on that
# thread and the process dies of SIGABRT, so no rank could say where it was. 2 ("clean up only") aborts the
# group's communicators and lets the process live: the training thread then gets a DistBackendError from
# Work.wait() or from the next operation on the aborted communicator, which failures.py turns into the
# one-line error and exit code 3 (run.py ends the rank with os._exit, well within the 8 minutes,
# TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, after which NCCL's heartbeat monitor ends a process whose collective timed
# out). Waits stay asynchronous (the host keeps queueing kernels ahead of the GPU); TORCH_NCCL_BLOCKING_WAIT=1
# would raise at the very wait that timed out, at the price of the host blocking on every wait. A setting the
# user made (under either of torch's names) is kept.
NCCL_ERROR_HANDLING_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
NCCL_CLEAN_UP_ONLY = "2"


def nccl_error_handling(environ: MutableMapping[str, str]) -> str:
    """Select NCCL's error handling in ``environ`` (read when an NCCL group is created) unless the user did;
    returns the mode in force."""
    for name in NCCL_ERROR_HANDLING_VARS:
        if name in environ:
            return environ[name]
    environ[NCCL_ERROR_HANDLING_VARS[0]] = NCCL_CLEAN_UP_ONLY
    return NCCL_CLEAN_UP_ONLY


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @staticmethod
    def from_environ() -> "LaunchEnv":
        world = int(os.environ.get("WORLD_SIZE", 1))
        return LaunchEnv(
            rank=int(os.environ.get("RANK", 0)),
            world_size=world,
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_timeout(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s)


def init_distributed(env: LaunchEnv, device, *, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> None:
    """Join the job's process group; a lone process forms a world of one on a free local port. Its waits
    are bounded by ``timeout_s`` (run.py: ``--startup-timeout``); every group the engine creates later is
    given a timeout where it is made (mesh.py, ``background_group``, ``host_group``): torch's module
    defaults, which a group made without one takes, are 10 minutes for NCCL and 30 for gloo. Training then
    moves every group to its phase's timeout (runtime/distributed/timeouts.py)."""
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    timeout = collective_timeout(timeout_s)
    backend = backend_for(device)
    if backend == "nccl":
        nccl_error_handling(os.environ)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None:
        # After `torchrun --max-restarts` restarts the workers, the rendezvous store it shares with them
        # still holds the previous attempt's addresses, and gloo connects to the dead ranks' ports
        # ("connectFullMesh failed ... Connection refused"; pytorch/pytorch issue 135712). Each attempt
        # gets keys of its own.
        store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
        kwargs["store"] = dist.PrefixStore(f"attempt_{restart}", store)
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs)


def background_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over every rank for work on a background thread (asynchronous checkpoint writes of
    CPU copies): its collectives never interleave with the training thread's on the world group."""
    return dist.new_group(backend="gloo", timeout=collective_timeout(timeout_s))


def host_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over every rank for host-side objects (a profile's spans): where the world's backend is
    NCCL, its messages would otherwise be staged through device memory."""
    return dist.new_group(backend="gloo", timeout=collective_timeout(timeout_s))


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
