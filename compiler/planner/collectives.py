"""Collectives and point-to-point messages on a cluster's links: the one copy of every formula.

Ring all-reduce over n ranks: 2 (n - 1) / n * S / bandwidth plus a latency per step; all-gather and
reduce-scatter half of that each (Patarasuk and Yuan 2009; Thakur et al. 2005). Steps: 2 (n - 1) in a
ring inside a node; across nodes NCCL's trees take 2 log2 n latency steps. All-to-all (expert dispatch):
each rank sends (n - 1) / n of its S bytes, one message per peer (pairwise exchange). A point-to-point
message: latency + S / bandwidth. DeepEP's deduplicated dispatch: ``deduplicated_dispatch_time``.

Which link a group uses (``Topology.group_link``): ranks are numbered by the mesh's dimensions, innermost
fastest (the engine's order: dp, pp, cp, mp, mp innermost), so a group of ``members`` ranks ``stride``
apart has k = devices_per_node / stride of them on a node (at least one). Inside one node it runs at the
device's NVLink (or, on a CPU, its measured gloo) rate; across nodes at min(NVLink, k x NIC) per rank,
since the k members of a node drive k NICs at once (NCCL runs a ring per NIC). Bandwidths are per device,
one direction, times the link efficiency collectives reach as bus bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction, per rank
    latency: float  # seconds per message / collective step
    tree: bool = False  # latency grows with log2 n (NCCL's trees across nodes) rather than per ring step

    def transfer(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def steps(self, n: int) -> float:
        return 2 * math.ceil(math.log2(n)) if self.tree else 2 * (n - 1)


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + link.steps(n) * link.latency


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """All-gather to ``nbytes`` in total; also the time of a reduce-scatter of ``nbytes``."""
    return all_reduce_time(nbytes, n, link) / 2


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """Every rank exchanges ``nbytes`` of its own with the others (1/n of it stays)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def groups_hit(experts: int, top_k: int, groups: int) -> float:
    """Expected number of ``groups`` equal groups of ``experts`` that a token's ``top_k`` distinct experts fall
    in under uniform routing: groups x (1 - C(E - E/groups, k) / C(E, k)) (each group is missed with the
    hypergeometric probability of drawing none of its E/groups experts)."""
    if groups <= 1:
        return 1.0
    per_group = experts // groups
    return groups * (1 - math.comb(experts - per_group, top_k) / math.comb(experts, top_k))


def deduplicated_dispatch_time(token_bytes: float, *, experts: int, top_k: int, ranks: int, ranks_per_node: int,
                               intra: Link, inter: Link) -> float:
    """One dispatch (or combine) of a rank's tokens, ``token_bytes`` in all, by DeepEP's normal kernels: a
    token goes once to each destination rank (not once per expert), and across nodes once over the network to
    each destination node's GPU of the same local index, which forwards it over NVLink to that node's
    destination ranks (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 3.2.2; DeepEP csrc/kernels/
    internode.cu: one RDMA transfer per token and node, with a bit per local rank). Network and NVLink bytes
    are priced one after the other, as ``all_to_all_time`` prices a mixed group."""
    if ranks <= 1:
        return 0.0
    copies = token_bytes * groups_hit(experts, top_k, ranks)  # one per destination rank
    nodes = -(-ranks // ranks_per_node)
    if nodes == 1:
        return all_to_all_time(copies, ranks, intra)
    network = token_bytes * groups_hit(experts, top_k, nodes) * (nodes - 1) / nodes
    forwarded = copies * (ranks_per_node - 1) / ranks_per_node
    return network / inter.bandwidth + forwarded / intra.bandwidth + (nodes - 1) * inter.latency


@dataclass(frozen=True)
class Topology:
    """Devices per node and the two kinds of link (raw rates; ``efficiency`` is applied by ``group_link``)."""
    devices_per_node: int
    intra: Link  # inside a node: NVLink / NVSwitch, or a CPU's shared memory (gloo)
    inter: Link  # across nodes: the device's share of the node's NICs
    efficiency: float = 1.0  # fraction of a link's rate collectives reach as bus bandwidth
    nodes: int | None = None  # the most nodes there are (None: as many as a world needs)

    def members_per_node(self, members: int, stride: int) -> int:
        return max(1, min(members, self.devices_per_node // stride)) if stride <= self.devices_per_node else 1

    def spans_nodes(self, members: int, stride: int) -> bool:
        return members > self.members_per_node(members, stride)

    def group_link(self, members: int, stride: int) -> Link:
        """The link a collective over ``members`` ranks ``stride`` apart runs at (module docstring)."""
        k = self.members_per_node(members, stride)
        if members <= k:
            return self.nvlink()
        bandwidth = min(self.intra.bandwidth, k * self.inter.bandwidth) * self.efficiency
        return Link(bandwidth, self.inter.latency, tree=True)

    def dims_link(self, dims: list[tuple[int, int]]) -> Link:
        """A group spanning several mesh dimensions, (members, stride) each: members per node multiply."""
        members = 1
        per_node = 1
        for n, stride in dims:
            members *= n
            per_node *= self.members_per_node(n, stride)
        per_node = min(per_node, self.devices_per_node, members)
        if members <= per_node:
            return self.nvlink()
        return Link(min(self.intra.bandwidth, per_node * self.inter.bandwidth) * self.efficiency, self.inter.latency,
                    tree=True)

    def neighbour_link(self, members: int, stride: int) -> Link:
        """A point-to-point message between neighbours of such a group: one NIC when the group spans nodes."""
        if self.spans_nodes(members, stride):
            return self.network()
        return self.nvlink()

    def nvlink(self) -> Link:
        """One rank's link inside a node (NVLink, or a CPU's gloo), at the collectives' efficiency."""
        return Link(self.intra.bandwidth * self.efficiency, self.intra.latency)

    def network(self) -> Link:
        """One rank's share of the node's NICs, at the collectives' efficiency."""
        return Link(self.inter.bandwidth * self.efficiency, self.inter.latency)

    def all_to_all_link(self, members: int, stride: int) -> Link:
        """All-to-all across nodes: each rank's off-node share leaves through its own NIC."""
        return self.spread_link(members, self.members_per_node(members, stride))

    def spread_link(self, members: int, per_node: int) -> Link:
        """An all-to-all over ``members`` ranks, ``per_node`` of them on each node: the off-node share of a
        rank's bytes crosses the network, the rest goes over NVLink."""
        if members <= per_node:
            return self.nvlink()
        off_node = (members - per_node) / members
        seconds_per_byte = off_node / self.inter.bandwidth + (1 - off_node) / self.intra.bandwidth
        return Link(1 / seconds_per_byte * self.efficiency, self.inter.latency)

    def nodes_for(self, world: int) -> int:
        return -(-world // self.devices_per_node)

    def world_error(self, world: int, name: str) -> str | None:
        """Why this cluster cannot host ``world`` devices, or None."""
        if self.nodes is not None and world > self.nodes * self.devices_per_node:
            return (f"--world {world} exceeds the cluster {name}: {self.nodes} nodes x {self.devices_per_node} "
                    f"devices = {self.nodes * self.devices_per_node}")
        if world > self.devices_per_node and world % self.devices_per_node:
            return (f"--world {world} must be a multiple of the {self.devices_per_node} devices per node of "
                    f"{name} (or at most one node)")
        return None
