"""The (dp, pp, mp) device mesh and its rank layout, with the context-parallel (cp) and expert-parallel (ep)
dimensions when asked for.

Ranks are laid out row-major over (dp, pp, cp, mp): rank = ((d * pp + p) * cp + c) * mp + m (cp = 1 gives the
(dp, pp, mp) layout). MP is the fastest dimension so that tensor-parallel peers, which all-reduce twice per
block, are neighbours on one node; context-parallel peers, which all-gather keys and values in every
attention layer, come next.

With hybrid sharding (``dp_shard`` < dp) the dp index splits as d = r * dp_shard + s: a shard group is
dp_shard consecutive replicas (near each other, like a node's GPUs) and the replicate groups span them.
Expert parallelism borrows from data parallelism without changing any rank's place: the dp index splits as
d = o * ep + e, and an EP group is ep consecutive replicas (the same pp, cp and mp), each holding 1/ep of every
mixture-of-experts layer's experts; the experts are sharded over the other dp/ep replicas (and cp and mp ranks,
which hold different tokens) by FSDP.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from compiler.parallelize.expert_parallel import MoeMeshes
from compiler.torch_compat import flatten_mesh, group_options, unflatten_mesh

MESH_DIMS = ("dp", "pp", "mp")


@dataclass(frozen=True)
class GridLayout:
    dp: int
    pp: int
    mp: int
    dp_shard: int | None = None  # ranks a parameter is sharded over in data parallelism (None: dp)
    cp: int = 1  # context-parallel ranks: each holds 1/cp of every sequence
    ep: int = 1  # expert-parallel ranks, borrowed from dp: each holds 1/ep of every MoE layer's experts

    @property
    def shard(self) -> int:
        return self.dp_shard or self.dp

    @property
    def replicated(self) -> bool:
        """Every data-parallel rank holds the whole stage (``--dp-shard 1`` with dp > 1: DDP's layout). With
        dp 1 and cp > 1 the cp ranks shard the parameters (FSDP over dp x cp, as torchtitan's dp_shard_cp)."""
        return self.dp > 1 and self.shard == 1

    @property
    def sharded(self) -> bool:
        """FSDP or HSDP over the data-parallel ranks (dp x cp)."""
        return self.dp * self.cp > 1 and not self.replicated

    @property
    def plane_size(self) -> int:
        """Ranks sharing one pipeline stage (dp x cp x mp); each reports the mean loss of an equal share of the
        batch, so the global mean is their sum over this many."""
        return self.dp * self.cp * self.mp

    @property
    def sum_copies(self) -> int:
        """Ranks reporting the same summed loss: a replica's mp tensor-parallel peers (dp replicas and cp ranks sum
        different tokens)."""
        return self.mp

    @property
    def dims(self) -> tuple[str, ...]:
        """The mesh's dimension names, outermost first: (dp, pp, mp), or (dp, pp, cp, mp) with cp > 1."""
        return ("dp", "pp", "cp", "mp") if self.cp > 1 else MESH_DIMS

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.mp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, mp) indices of ``rank`` (its cp index: ``cp_index``)."""
        d, rest = divmod(rank, self.pp * self.cp * self.mp)
        p, rest = divmod(rest, self.cp * self.mp)
        return d, p, rest % self.mp

    def cp_index(self, rank: int) -> int:
        return rank // self.mp % self.cp

    def rank(self, dp: int, pp: int, mp: int, cp: int = 0) -> int:
        return ((dp * self.pp + pp) * self.cp + cp) * self.mp + mp

    def groups(self, dim: str) -> list[list[int]]:
        """Every process group along ``dim`` (dp, pp, cp, mp): the ranks that differ only in that coordinate."""
        sizes = {"dp": self.dp, "pp": self.pp, "cp": self.cp, "mp": self.mp}
        groups = []
        for r in range(self.world):
            coords = dict(zip(("dp", "pp", "mp"), self.coordinates(r)), cp=self.cp_index(r))
            if coords[dim] == 0:
                groups.append([self.rank(**{**coords, dim: i}) for i in range(sizes[dim])])
        return sorted(groups)

    def dp_subgroups(self) -> tuple[list[list[int]], list[list[int]]]:
        """(shard groups, replicate groups) of data parallelism: each dp group split by d = r * shard + s."""
        shard_groups, replicate_groups = [], []
        for group in self.groups("dp"):
            shard_groups += [group[i:i + self.shard] for i in range(0, self.dp, self.shard)]
            replicate_groups += [group[s::self.shard] for s in range(self.shard)]
        return sorted(shard_groups), sorted(replicate_groups)

    def ep_groups(self) -> list[list[int]]:
        """The expert-parallel groups: ep consecutive dp replicas of each (pp, cp, mp) place."""
        return sorted(group[i:i + self.ep] for group in self.groups("dp") for i in range(0, self.dp, self.ep))

    def describe(self) -> str:
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        lines = [f"{'4D' if self.cp > 1 else '3D'} grid (dp={self.dp}, pp={self.pp}{cp}, mp={self.mp}), {self.world} ranks:"]
        for r in range(self.world):
            d, p, m = self.coordinates(r)
            lines.append(f"  rank {r}: dp={d} pp={p}" + (f" cp={self.cp_index(r)}" if self.cp > 1 else "") + f" mp={m}")
        for dim in ("mp", "cp", "pp", "dp") if self.cp > 1 else ("mp", "pp", "dp"):
            lines.append(f"  {dim.upper()} groups: " + " ".join(str(g) for g in self.groups(dim)))
        if self.ep > 1:
            lines.append("  EP groups (each holds 1/%d of every MoE layer's experts): " % self.ep
                         + " ".join(str(g) for g in self.ep_groups()))
        if self.dp * self.cp > 1:
            shard, replicate = self.dp_subgroups()
            over = " x cp" if self.cp > 1 else ""
            mode = (f"FSDP: shard over all dp{over} ranks" if self.shard == self.dp else
                    f"replicate: every dp{over} rank holds the whole stage" if self.shard == 1 else
                    f"HSDP: shard over {self.shard}{over} ranks, replicate over {self.dp // self.shard}")
            lines.append(f"  data parallelism: {mode}")
            if 1 < self.shard < self.dp:
                lines.append("  DP shard groups: " + " ".join(str(g) for g in shard))
                lines.append("  DP replicate groups: " + " ".join(str(g) for g in replicate))
        return "\n".join(lines)


def grid_layout(plan) -> GridLayout:
    """The rank layout of a plan (compiler/parallel_plan.py ParallelPlan)."""
    return GridLayout(plan.dp, plan.pp, plan.mp, plan.shard, cp=plan.cp, ep=plan.ep)


def build_mesh(device_type: str, layout: GridLayout, *, timeout: datetime.timedelta) -> DeviceMesh:
    """The (dp, pp, mp) mesh, (dp, pp, cp, mp) with cp > 1; every group it creates bounds its waits by
    ``timeout``. Collective: every rank calls it after the world's process group exists."""
    sizes = {"dp": layout.dp, "pp": layout.pp, "cp": layout.cp, "mp": layout.mp}
    sizes = {dim: sizes[dim] for dim in layout.dims}
    mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=layout.dims,
                            backend_override=_timed_groups(sizes, device_type, timeout))
    # init_device_mesh uses the same row-major layout; fail loudly if that ever changes.
    expected = torch.arange(layout.world).reshape(*sizes.values())
    if not torch.equal(mesh.mesh.cpu(), expected):
        raise RuntimeError(f"unexpected device-mesh layout {mesh.mesh.tolist()}")
    return mesh


def data_parallel_mesh(mesh: DeviceMesh, layout: GridLayout, *, timeout: datetime.timedelta) -> DeviceMesh:
    """The ranks that hold the same parameters and see different tokens: the dp replicas, times the cp ranks
    (each holds other positions of the same sequences). Gradients are averaged over them."""
    if layout.cp == 1:
        return mesh["dp"]
    return flatten_mesh(mesh["dp", "cp"], "dp_cp", backend_override=_timed(mesh.device_type, timeout))


def fsdp_mesh(mesh: DeviceMesh, layout: GridLayout, *, timeout: datetime.timedelta) -> DeviceMesh | None:
    """The mesh FSDP shards over: the data-parallel ranks (dp x cp: ``data_parallel_mesh``) for FSDP, unflattened
    into (replicate, shard x cp) for HSDP, or None where nothing is sharded (one rank, or replication:
    runtime/engine/replicate.py). Collective: every rank calls it (it creates the subgroups)."""
    if not layout.sharded:
        return None
    flat = data_parallel_mesh(mesh, layout, timeout=timeout)
    if layout.shard == layout.dp:
        return flat
    sizes = {"dp_replicate": layout.dp // layout.shard, "dp_shard": layout.shard * layout.cp}
    hybrid = unflatten_mesh(flat, flat.mesh_dim_names[0], tuple(sizes.values()), tuple(sizes),
                            backend_override=_timed_groups(sizes, mesh.device_type, timeout))
    return hybrid["dp_replicate", "dp_shard"]


def moe_meshes(mesh: DeviceMesh, layout: GridLayout, *, sequence_parallel: bool,
               timeout: datetime.timedelta) -> MoeMeshes:
    """The meshes a mixture-of-experts layer is parallelised over (compiler/parallelize/expert_parallel.py):
    ep consecutive dp replicas hold 1/ep of the experts each; the ranks that route other tokens through the same
    weights (the dp replicas, the cp ranks, and the mp ranks when sequence parallelism gives each its own tokens)
    shard them with FSDP and sum their gradients. Collective: every rank calls it."""
    sizes = {"dp_outer": layout.dp // layout.ep, "ep": layout.ep}
    regrouped = mesh if layout.ep == 1 else unflatten_mesh(
        mesh, "dp", tuple(sizes.values()), tuple(sizes), backend_override=_timed_groups(sizes, mesh.device_type, timeout))
    mp = layout.mp if sequence_parallel else 1
    experts = [name for name, size in (("dp_outer" if layout.ep > 1 else "dp", layout.dp // layout.ep),
                                       ("cp", layout.cp), ("mp", mp)) if size > 1]
    if layout.ep > 1 and not experts:  # FSDP over one rank: it still divides the EP group's summed gradients
        experts = ["dp_outer"]
    tokens = [name for name, size in (("dp", layout.dp), ("cp", layout.cp), ("mp", mp)) if size > 1]
    sequence = [name for name, size in (("cp", layout.cp), ("mp", mp)) if size > 1]
    return MoeMeshes(ep=regrouped["ep"] if layout.ep > 1 else None,
                     experts=_joined(regrouped, experts, "expert_shard", timeout),
                     tokens=_joined(mesh, tokens, "moe_tokens", timeout),
                     sequence=_joined(mesh, sequence, "sequence_shards", timeout),
                     replicas=layout.dp * layout.cp)


def _joined(mesh: DeviceMesh, dims: list[str], name: str, timeout: datetime.timedelta) -> DeviceMesh | None:
    """``mesh``'s dimensions ``dims`` as one (None for none)."""
    if not dims:
        return None
    if len(dims) == 1:
        return mesh[dims[0]]
    return flatten_mesh(mesh[tuple(dims)], name, backend_override=_timed(mesh.device_type, timeout))


def _timed(device_type: str, timeout: datetime.timedelta):
    return group_options(dist.get_backend(), timeout)


def _timed_groups(sizes: dict[str, int], device_type: str, timeout: datetime.timedelta) -> dict:
    """DeviceMesh's per-dimension overrides that carry ``timeout`` (it takes a timeout only inside group
    options: compiler/torch_compat.py). A dimension spanning the world keeps torch's reuse of the world
    group, which has the timeout already (and on NCCL a communicator costs device memory), except where
    torch would not reuse it: a gloo world on a machine with CUDA (``--device cpu`` on a GPU machine) gets a
    fresh group for that dimension (device_mesh.py ``_init_one_process_group``, 2.11 and 2.13)."""
    world, backend = dist.get_world_size(), dist.get_backend()
    fresh_world_group = device_type == "cpu" and torch.cuda.is_available()
    return {name: group_options(backend, timeout) for name, size in sizes.items() if size != world or fresh_world_group}
