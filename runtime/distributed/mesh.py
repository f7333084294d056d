"""The (dp, pp, mp) device mesh and its rank layout.

Ranks are laid out row-major over (dp, pp, mp): rank = (d * pp + p) * mp + m. MP is the fastest
dimension so that tensor-parallel peers, which all-reduce twice per block, are neighbours on one node.

With hybrid sharding (``dp_shard`` < dp) the dp index splits as d = r * dp_shard + s: a shard group is
dp_shard consecutive replicas (near each other, like a node's GPUs) and the replicate groups span them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from compiler.torch_compat import group_options, unflatten_mesh

MESH_DIMS = ("dp", "pp", "mp")


@dataclass(frozen=True)
class GridLayout:
    dp: int
    pp: int
    mp: int
    dp_shard: int | None = None  # ranks a parameter is sharded over in data parallelism (None: dp)

    @property
    def shard(self) -> int:
        return self.dp_shard or self.dp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        d, rest = divmod(rank, self.pp * self.mp)
        p, m = divmod(rest, self.mp)
        return d, p, m

    def rank(self, dp: int, pp: int, mp: int) -> int:
        return (dp * self.pp + pp) * self.mp + mp

    def groups(self, dim: str) -> list[list[int]]:
        """Every process group along ``dim``: the ranks that differ only in that coordinate."""
        sizes = {"dp": self.dp, "pp": self.pp, "mp": self.mp}
        others = [k for k in MESH_DIMS if k != dim]
        groups = []
        for a in range(sizes[others[0]]):
            for b in range(sizes[others[1]]):
                coords = {others[0]: a, others[1]: b}
                groups.append([self.rank(**{**coords, dim: i}) for i in range(sizes[dim])])
        return sorted(groups)

    def dp_subgroups(self) -> tuple[list[list[int]], list[list[int]]]:
        """(shard groups, replicate groups) of data parallelism: each dp group split by d = r * shard + s."""
        shard_groups, replicate_groups = [], []
        for group in self.groups("dp"):
            shard_groups += [group[i:i + self.shard] for i in range(0, self.dp, self.shard)]
            replicate_groups += [group[s::self.shard] for s in range(self.shard)]
        return sorted(shard_groups), sorted(replicate_groups)

    def describe(self) -> str:
        world = self.dp * self.pp * self.mp
        lines = [f"3D grid (dp={self.dp}, pp={self.pp}, mp={self.mp}), {world} ranks:"]
        lines += [f"  rank {r}: dp={d} pp={p} mp={m}" for r in range(world) for d, p, m in [self.coordinates(r)]]
        for dim in ("mp", "pp", "dp"):
            lines.append(f"  {dim.upper()} groups: " + " ".join(str(g) for g in self.groups(dim)))
        if self.dp > 1:
            shard, replicate = self.dp_subgroups()
            mode = ("FSDP: shard over all dp ranks" if self.shard == self.dp else
                    "replicate: every dp rank holds the whole stage" if self.shard == 1 else
                    f"HSDP: shard over {self.shard} ranks, replicate over {self.dp // self.shard}")
            lines.append(f"  data parallelism: {mode}")
            if 1 < self.shard < self.dp:
                lines.append("  DP shard groups: " + " ".join(str(g) for g in shard))
                lines.append("  DP replicate groups: " + " ".join(str(g) for g in replicate))
        return "\n".join(lines)


def build_mesh(device_type: str, layout: GridLayout, *, timeout: datetime.timedelta) -> DeviceMesh:
    """The (dp, pp, mp) mesh; every group it creates bounds its waits by ``timeout`` (--collective-timeout).
    Collective: every rank calls it after the world's process group exists."""
    sizes = dict(zip(MESH_DIMS, (layout.dp, layout.pp, layout.mp)))
    mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=MESH_DIMS,
                            backend_override=_timed_groups(sizes, device_type, timeout))
    # init_device_mesh uses the same row-major layout; fail loudly if that ever changes.
    expected = torch.arange(layout.dp * layout.pp * layout.mp).reshape(layout.dp, layout.pp, layout.mp)
    if not torch.equal(mesh.mesh.cpu(), expected):
        raise RuntimeError(f"unexpected device-mesh layout {mesh.mesh.tolist()}")
    return mesh


def fsdp_mesh(mesh: DeviceMesh, layout: GridLayout, *, timeout: datetime.timedelta) -> DeviceMesh | None:
    """The mesh FSDP shards over: mesh["dp"] (FSDP), dp unflattened into (replicate, shard) for HSDP, or
    None where nothing is sharded (one replica, or replication: runtime/engine/replicate.py).
    Collective: every rank calls it (it creates the subgroups)."""
    if layout.dp == 1 or layout.shard == 1:
        return None
    if layout.shard == layout.dp:
        return mesh["dp"]
    sizes = {"dp_replicate": layout.dp // layout.shard, "dp_shard": layout.shard}
    hybrid = unflatten_mesh(mesh, "dp", tuple(sizes.values()), tuple(sizes),
                            backend_override=_timed_groups(sizes, mesh.device_type, timeout))
    return hybrid["dp_replicate", "dp_shard"]


def _timed_groups(sizes: dict[str, int], device_type: str, timeout: datetime.timedelta) -> dict:
    """DeviceMesh's per-dimension overrides that carry ``timeout`` (it takes a timeout only inside group
    options: compiler/torch_compat.py). A dimension spanning the world keeps torch's reuse of the world
    group, which has the timeout already (and on NCCL a communicator costs device memory), except where
    torch would not reuse it: a gloo world on a machine with CUDA (``--device cpu`` on a GPU machine) gets a
    fresh group for that dimension (device_mesh.py ``_init_one_process_group``, 2.11 and 2.13)."""
    world, backend = dist.get_world_size(), dist.get_backend()
    fresh_world_group = device_type == "cpu" and torch.cuda.is_available()
    return {name: group_options(backend, timeout) for name, size in sizes.items() if size != world or fresh_world_group}
