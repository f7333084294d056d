"""One rank of a pretended world, in the test's own process: torch's "fake" process-group backend
(its testing utilities) answers every collective at once without moving data, so the code that builds
meshes, groups and shards can be run as rank r of N without launching N processes."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def fake_world(*, rank: int, world_size: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
