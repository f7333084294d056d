"""Process-group start-up and tear-down, for torchrun ranks and for a plain ``python run.py``."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

from runtime.device import backend_for

# Long enough for a slow first step (tracing, p2p warm-up) on an oversubscribed CPU, short enough
# that a rank stuck on a dead peer gives up instead of hanging a job for the default 30 minutes.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


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


def init_distributed(env: LaunchEnv, device) -> None:
    """Join the job's process group; a lone process forms a world of one on a free local port."""
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend_for(device), rank=env.rank, world_size=env.world_size,
                            timeout=COLLECTIVE_TIMEOUT, **kwargs)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
