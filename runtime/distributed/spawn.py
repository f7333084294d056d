"""Run a function on N fresh local processes forming one gloo job (env:// rendezvous on a free port).

Used where a real multi-process job is needed without torchrun: calibration's concurrent measurements
and the tests. Every wait has a timeout, and a rank that fails ends the whole job (its peers are
killed) instead of leaving them blocked in a collective.

With ``preload`` the ranks are forked from a fork server that imported those modules once (and ran
nothing else: no threads, no process group), instead of each starting a fresh interpreter that imports
torch, DTensor, FSDP and pipelining again (~5 s of CPU per rank here, 20 s of wall time for 8 ranks on
2 cores). The fork server is started once per process, with the first call's preload list.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from runtime.distributed.process_group import free_port


class SpawnError(RuntimeError):
    """A spawned rank failed or the job did not finish in time; the message holds every rank's traceback."""


def _rank_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors, env: dict) -> None:
    # The caller's environment as it is now (a fork server's children would otherwise see the server's,
    # from when it started).
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    try:
        fn(*args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    # The rank's work is done. Skip interpreter finalization: gloo's worker threads can still hold
    # tensors then, and releasing them without a live interpreter aborts the process ("terminate called
    # without an active exception", SIGABRT; pytorch/pytorch PR 179291), seen once after all work passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn: Callable[..., Any], *, world_size: int, args: tuple = (), timeout: float = 300,
                preload: tuple[str, ...] = ()) -> None:
    """Run ``fn(*args)`` on ``world_size`` processes (RANK, WORLD_SIZE, MASTER_* set); raise SpawnError if
    any rank fails or the job outlives ``timeout`` seconds. ``preload``: modules a fork server imports once
    for every rank (see the module's docstring); none: a fresh interpreter per rank."""
    if preload:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
    else:
        ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_rank_entry, args=(r, world_size, port, fn, args, errors, env), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs):
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        timed_out = any(p.is_alive() for p in procs) and not failed
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
    messages = []
    while not errors.empty():
        rank, tb = errors.get()
        messages.append(f"--- rank {rank} ---\n{tb}")
    if timed_out:
        raise SpawnError(f"ranks did not finish within {timeout}s\n" + "\n".join(messages))
    if failed:
        raise SpawnError(f"ranks failed (rank, exit code): {failed}\n" + "\n".join(messages))
