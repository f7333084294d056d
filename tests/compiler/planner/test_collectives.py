"""Collective formulas and link choice against hand computations (compiler/planner/collectives.py)."""

from __future__ import annotations

import pytest

from compiler.planner.collectives import (
    Link,
    Topology,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    deduplicated_dispatch_time,
    groups_hit,
)

NVLINK, NIC = Link(450e9, 5e-6), Link(50e9, 10e-6)
NODE = Topology(8, NVLINK, NIC, efficiency=0.8)


def test_ring_all_reduce_all_gather_and_all_to_all():
    link = Link(bandwidth=1e9, latency=1e-5)
    assert all_reduce_time(1e9, 1, link) == 0 and all_to_all_time(1e9, 1, link) == 0
    assert all_reduce_time(1e9, 4, link) == pytest.approx(2 * 3 / 4 * 1.0 + 6 * 1e-5)
    assert all_gather_time(1e9, 4, link) == pytest.approx(all_reduce_time(1e9, 4, link) / 2)
    assert all_to_all_time(1e9, 4, link) == pytest.approx(3 / 4 * 1.0 + 3 * 1e-5)
    tree = Link(1e9, 1e-5, tree=True)  # across nodes: 2 log2 n latency steps
    assert all_reduce_time(1e9, 64, tree) == pytest.approx(2 * 63 / 64 + 12 * 1e-5)


def test_a_group_inside_a_node_runs_at_nvlink():
    link = NODE.group_link(8, 1)
    assert (link.bandwidth, link.latency, link.tree) == (450e9 * 0.8, 5e-6, False)


def test_members_per_node_share_nics_across_nodes():
    # 16 consecutive ranks: 8 per node drive 8 NICs, capped by NVLink.
    assert NODE.group_link(16, 1).bandwidth == pytest.approx(min(450e9, 8 * 50e9) * 0.8)
    # 16 ranks 2 apart: 4 per node, 4 NICs.
    assert NODE.group_link(16, 2).bandwidth == pytest.approx(4 * 50e9 * 0.8)
    # 64 ranks 8 apart (dp outside a TP x PP block of 8): one per node, one NIC, tree latency.
    link = NODE.group_link(64, 8)
    assert link.bandwidth == pytest.approx(50e9 * 0.8) and link.tree
    # A group over two mesh dimensions: 2 cp neighbours x 2 dp neighbours 4 apart fit one node.
    assert not NODE.dims_link([(2, 1), (2, 4)]).tree
    assert NODE.dims_link([(2, 1), (8, 8)]).bandwidth == pytest.approx(2 * 50e9 * 0.8)


def test_all_to_all_across_nodes_sends_the_off_node_share_through_the_nic():
    link = NODE.all_to_all_link(32, 1)  # 8 of 32 members per node: 3/4 of each rank's bytes leave the node
    per_byte = 0.75 / 50e9 + 0.25 / 450e9
    assert link.bandwidth == pytest.approx(0.8 / per_byte)


def test_a_tokens_top_k_experts_fall_in_fewer_distinct_groups():
    # 4 experts in 2 groups of 2, top 2: of the 6 expert pairs, 2 lie in one group, 4 span both.
    assert groups_hit(4, 2, 2) == pytest.approx((2 * 1 + 4 * 2) / 6)
    assert groups_hit(128, 8, 1) == 1 and groups_hit(128, 8, 128) == pytest.approx(8)  # one expert per group
    # 128 experts over 4 nodes, top 8: a node is missed with probability C(96, 8) / C(128, 8).
    miss = 1.0
    for i in range(8):
        miss *= (96 - i) / (128 - i)
    assert groups_hit(128, 8, 4) == pytest.approx(4 * (1 - miss))


def test_deepep_sends_a_token_once_per_rank_and_once_per_node_across_the_network():
    tokens = 1e9  # a rank's tokens, d x bytes each
    # Inside a node: one copy per destination rank instead of one per expert.
    inside = deduplicated_dispatch_time(tokens, experts=128, top_k=8, ranks=8, ranks_per_node=8, intra=NVLINK,
                                        inter=NIC)
    assert inside == pytest.approx(all_to_all_time(tokens * groups_hit(128, 8, 8), 8, NVLINK))
    # 32 ranks on 4 nodes: the network carries one copy per other node hit, NVLink forwards the rank copies.
    across = deduplicated_dispatch_time(tokens, experts=128, top_k=8, ranks=32, ranks_per_node=8, intra=NVLINK,
                                        inter=NIC)
    network = tokens * groups_hit(128, 8, 4) * 3 / 4
    forwarded = tokens * groups_hit(128, 8, 32) * 7 / 8
    assert across == pytest.approx(network / 50e9 + forwarded / 450e9 + 3 * 10e-6)
    # Against one copy per (token, expert), 3/4 of them off the node: under half the network bytes.
    assert network < 0.5 * tokens * 8 * 3 / 4


def test_pipeline_neighbours_use_one_nic_once_the_group_spans_nodes():
    assert NODE.neighbour_link(4, 2).bandwidth == pytest.approx(450e9 * 0.8)
    assert NODE.neighbour_link(16, 8).bandwidth == pytest.approx(50e9 * 0.8)


def test_world_errors():
    bounded = Topology(8, NVLINK, NIC, nodes=2)
    assert bounded.world_error(16, "x") is None and "exceeds" in bounded.world_error(24, "x")
    assert "multiple" in NODE.world_error(12, "x") and NODE.world_error(4, "x") is None
