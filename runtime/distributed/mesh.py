"""The (dp, pp, mp) device mesh and its rank layout.

Ranks are laid out row-major over (dp, pp, mp): rank = (d * pp + p) * mp + m. MP is the fastest
dimension so that tensor-parallel peers, which all-reduce twice per block, are neighbours on one node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp", "pp", "mp")


@dataclass(frozen=True)
class GridLayout:
    dp: int
    pp: int
    mp: int

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

    def describe(self) -> str:
        world = self.dp * self.pp * self.mp
        lines = [f"3D grid (dp={self.dp}, pp={self.pp}, mp={self.mp}), {world} ranks:"]
        lines += [f"  rank {r}: dp={d} pp={p} mp={m}" for r in range(world) for d, p, m in [self.coordinates(r)]]
        for dim in ("mp", "pp", "dp"):
            lines.append(f"  {dim.upper()} groups: " + " ".join(str(g) for g in self.groups(dim)))
        return "\n".join(lines)


def build_mesh(device_type: str, layout: GridLayout) -> DeviceMesh:
    mesh = init_device_mesh(device_type, (layout.dp, layout.pp, layout.mp), mesh_dim_names=MESH_DIMS)
    # init_device_mesh uses the same row-major layout; fail loudly if that ever changes.
    expected = torch.arange(layout.dp * layout.pp * layout.mp).reshape(layout.dp, layout.pp, layout.mp)
    if not torch.equal(mesh.mesh.cpu(), expected):
        raise RuntimeError(f"unexpected device-mesh layout {mesh.mesh.tolist()}")
    return mesh
