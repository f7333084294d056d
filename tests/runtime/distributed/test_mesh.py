"""The (dp, pp, mp) rank layout: printed groups, coordinates, and agreement with torch's DeviceMesh (whose
groups carry --collective-timeout)."""

from __future__ import annotations

import datetime
import json

import pytest

from runtime.distributed.mesh import GridLayout
from tests.launch import spawn_ranks


def test_issue_example_2x2x2_groups():
    layout = GridLayout(2, 2, 2)
    assert layout.groups("mp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    text = layout.describe()
    assert "MP groups: [0, 1] [2, 3] [4, 5] [6, 7]" in text
    assert "rank 5: dp=1 pp=0 mp=1" in text


@pytest.mark.parametrize("shape", [(1, 2, 4), (4, 2, 1), (2, 1, 2), (1, 1, 1), (2, 4, 1), (1, 8, 1)])
def test_layout_is_a_bijection_and_groups_partition_the_world(shape):
    layout = GridLayout(*shape)
    world = shape[0] * shape[1] * shape[2]
    coords = [layout.coordinates(r) for r in range(world)]
    assert len(set(coords)) == world
    assert all(layout.rank(*c) == r for r, c in enumerate(coords))
    for dim, size in zip(("dp", "pp", "mp"), shape):
        groups = layout.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
        axis = ("dp", "pp", "mp").index(dim)
        for g in groups:  # members differ only in this dimension's coordinate
            other = {tuple(c for i, c in enumerate(layout.coordinates(r)) if i != axis) for r in g}
            assert len(other) == 1


def test_mp_groups_are_contiguous_ranks():
    # MP is the fastest dimension so that tensor-parallel peers share a node.
    assert GridLayout(2, 1, 4).groups("mp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _report_device_mesh_groups(shape, out_dir):
    import torch
    import torch.distributed as dist

    from compiler.torch_compat import group_timeout
    from runtime.distributed.mesh import build_mesh

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=41))
    mesh = build_mesh("cpu", GridLayout(*shape), timeout=datetime.timedelta(seconds=41))
    groups = {dim: dist.get_process_group_ranks(mesh[dim].get_group()) for dim in ("dp", "pp", "mp")}
    timeouts = {dim: group_timeout(mesh[dim].get_group(), torch.device("cpu")).total_seconds() for dim in groups}
    with open(f"{out_dir}/rank{dist.get_rank()}.json", "w") as f:
        json.dump({"groups": groups, "timeouts": timeouts}, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 2, 4)])
def test_device_mesh_groups_match_the_printed_layout(tmp_path, shape):
    spawn_ranks(_report_device_mesh_groups, world_size=8, args=(shape, str(tmp_path)), timeout=120)
    layout = GridLayout(*shape)
    for rank in range(8):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for dim in ("dp", "pp", "mp"):
            expected = next(g for g in layout.groups(dim) if rank in g)
            assert report["groups"][dim] == expected, (rank, dim)
            assert report["timeouts"][dim] == 41, (rank, dim)  # not torch's 30-minute default for gloo groups


@pytest.mark.parametrize("dp,pp,cp,mp,ep,shard", [(2, 2, 2, 1, 2, None), (4, 1, 2, 2, 2, 2), (2, 1, 1, 2, 2, 1),
                                                  (4, 2, 1, 1, 2, 2), (1, 2, 2, 2, 1, None)])
def test_cp_and_ep_meshes_hold_the_layouts_groups(dp, pp, cp, mp, ep, shard, monkeypatch):
    """The meshes torch builds for context and expert parallelism have the members GridLayout prints, for
    every rank of the world (torch's fake process group: no processes, and no group options: the timeouts
    are tested on real groups in tests/launches/test_process_group.py)."""
    from runtime.distributed import mesh as mesh_module
    from runtime.distributed.mesh import build_mesh, data_parallel_mesh, fsdp_mesh, moe_meshes
    from tests.fake_world import fake_world

    monkeypatch.setattr(mesh_module, "_timed_groups", lambda sizes, device_type, timeout: {})
    monkeypatch.setattr(mesh_module, "_timed", lambda device_type, timeout: None)

    layout = GridLayout(dp, pp, mp, shard, cp=cp, ep=ep)
    timeout = datetime.timedelta(seconds=30)
    for rank in range(layout.world):
        with fake_world(rank=rank, world_size=layout.world):
            mesh = build_mesh("cpu", layout, timeout=timeout)
            mine = lambda groups: next(g for g in groups if rank in g)  # noqa: E731
            d, p, m = layout.coordinates(rank)
            assert layout.rank(d, p, m, layout.cp_index(rank)) == rank
            if cp > 1:
                assert mesh["cp"].mesh.tolist() == mine(layout.groups("cp"))
            flat = data_parallel_mesh(mesh, layout, timeout=timeout).mesh.flatten().tolist()
            want = sorted(layout.rank(i, p, m, c) for i in range(dp) for c in range(cp))
            assert sorted(flat) == want, (flat, want)
            fsdp = fsdp_mesh(mesh, layout, timeout=timeout)
            if (dp > 1 and layout.shard == 1) or dp * cp == 1:  # replication; with dp 1, cp ranks shard
                assert fsdp is None
            else:
                assert sorted(fsdp.mesh.flatten().tolist()) == want and fsdp.size(fsdp.ndim - 1) == layout.shard * cp
            moe = moe_meshes(mesh, layout, sequence_parallel=True, timeout=timeout)
            if ep > 1:
                assert moe.ep.mesh.tolist() == mine(layout.ep_groups())
            holders = sorted(layout.rank(o * ep + d % ep, p, mm, c) for o in range(dp // ep) for c in range(cp)
                             for mm in range(mp))
            assert (moe.experts is None and holders == [rank]) or sorted(moe.experts.mesh.flatten().tolist()) == holders
            routers = sorted(layout.rank(i, p, mm, c) for i in range(dp) for c in range(cp) for mm in range(mp))
            assert sorted(moe.tokens.mesh.flatten().tolist()) == routers
            sequence = sorted(layout.rank(d, p, mm, c) for c in range(cp) for mm in range(mp))
            assert (moe.sequence is None and sequence == [rank]) or sorted(moe.sequence.mesh.flatten().tolist()) == sequence
            assert moe.replicas == dp * cp
