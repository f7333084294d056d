"""Seconds of each kind of layer for one micro-batch on one rank: the device's compute (compiler/planner/
devices.py) of the layer's work (work.py), and the layer's collectives on the links of its groups
(collectives.py):

- tensor parallelism: Megatron's f and g, two all-reduces of [b, T / cp, d] forward and two backward per
  block (with sequence parallelism an all-gather and a reduce-scatter each, the same volume: Korthikanti et
  al. 2022); a MoE block's MLP runs on sequence shards (expert tensor parallelism 1) and adds none; the
  vocabulary-parallel embedding's output all-reduce (a reduce-scatter under sequence parallelism) and the
  head's input-gradient all-reduce. With ``tp_overlap`` they hide behind the layer's matrix products.
- context parallelism: each attention all-gathers the sequence's K and V over cp forward and reduce-scatters
  their gradients backward (torchtitan's and Llama 3's all-gather CP); in this engine a sliding layer whose window
  reaches only the previous chunk receives just the W - 1 keys before each chunk from its neighbours, point to point
  (compiler/parallelize/halo.py), and sends their gradients back; multi-head latent attention gathers its latent and
  RoPE key instead where fewer (compiler/context_gather.py: r + rope values a token, whatever mp).
- expert parallelism: four all-to-alls per MoE block (dispatch and combine, forward and backward) of the
  rank's top_k token copies on the EP group's link; under DeepEP (engines.py ``ep_dispatch``) one copy per
  destination rank, and one per destination node across the network (collectives.py).
- activation checkpointing: full recompute runs the forward again (compute and its collectives: six TP
  collectives, a second K/V gather, six all-to-alls); selective recompute the memory-bound forward only
  (Megatron's ``--recompute-modules moe``, engines.py ``recomputes_moe``: and a MoE block's whole MLP, its
  products and its two forward all-to-alls).
- multi-token prediction (DeepSeek-V3 sec. 2.2): the head's layer also runs each depth on the last stage, its
  input (embedding, norms, projection), a block of the family's kind and the head and loss again.

Groups and links: ranks are numbered by the engine's mesh order (compiler/planner/engines.py); the TP
group is ``mp`` ranks ``stride_mp`` apart, CP ``cp`` ranks ``stride_cp`` apart; EP takes its ranks from
dp x cp x mp, innermost first.
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler.context_gather import LATENT, context_gather
from compiler.parallelize.halo import halo_width, kv_values_received
from compiler.planner.cluster import Cluster
from compiler.planner.collectives import Link, all_gather_time, all_reduce_time, all_to_all_time, deduplicated_dispatch_time
from compiler.planner.devices import ComputeSeconds
from compiler.planner.engines import EngineTraits
from compiler.planner.shape import DENSE, MOE, DecoderShape, mlp_kind, window_of
from compiler.planner.split import Holding
from compiler.planner.work import (
    EMBEDDING,
    HEAD,
    block_work,
    embedding_work,
    head_work,
    moe_mlp_work,
    moe_routed_shards,
    mtp_input_work,
)
from compiler.precisions import PRECISIONS
from models.spec import Experts


@dataclass(frozen=True)
class LayerSeconds:
    compute: ComputeSeconds  # recompute included
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0

    @property
    def comm(self) -> float:
        return self.tp + self.cp + self.ep

    @property
    def total(self) -> float:
        return self.compute.forward + self.compute.backward + self.comm

    def __add__(self, other: "LayerSeconds") -> "LayerSeconds":
        return LayerSeconds(self.compute + other.compute, self.tp + other.tp, self.cp + other.cp, self.ep + other.ep)

    def scaled(self, n: float) -> "LayerSeconds":
        return LayerSeconds(self.compute.scaled(n), self.tp * n, self.cp * n, self.ep * n)


ZERO = LayerSeconds(ComputeSeconds(0.0, 0.0, 0.0))


@dataclass(frozen=True)
class Setup:
    """How a rank runs its layers: everything the layer times depend on."""
    micro_batch_size: int
    precision: str
    mp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    ac: str = "none"
    dp: int = 1
    pp: int = 1
    fp8: str | None = None  # the FP8 recipe of the linear and expert products (compiler/fp8 RECIPES), or none
    cp_gather: str = "auto"  # what CP gathers for latent attention (ParallelPlan.cp_gather, compiler/context_gather.py)


@dataclass(frozen=True)
class LayerTable:
    """Seconds per micro-batch of the embedding, each kind of block and the head for one ``Setup``."""
    layers: dict[str, LayerSeconds]

    def rank(self, holding: Holding) -> LayerSeconds:
        total = ZERO
        for kind, n in holding.kinds:
            total = total + self.layers[kind].scaled(n)
        if holding.embedding:
            total = total + self.layers[EMBEDDING]
        if holding.head:
            total = total + self.layers[HEAD]
        return total


def _ep_ranks_per_node(cluster: Cluster, s: Setup, strides: dict[str, int]) -> int:
    """EP's ranks come from dp x cp x mp, innermost first: consecutive while they fit in cp x mp."""
    inner = s.mp * s.cp
    topology = cluster.topology
    if s.ep <= inner:
        return topology.members_per_node(s.ep, strides["mp"])
    return min(s.ep, topology.devices_per_node, inner * topology.members_per_node(s.ep // inner, strides["dp"]))


def _ep_dispatch_time(cluster: Cluster, traits: EngineTraits, s: Setup, strides: dict[str, int], *,
                      token_bytes: float, experts: Experts) -> float:
    """One dispatch or combine of a rank's ``token_bytes`` of tokens over the EP group (engines.py
    ``ep_dispatch``)."""
    t = cluster.topology
    per_node = _ep_ranks_per_node(cluster, s, strides)
    if traits.ep_dispatch == "deepep":
        return deduplicated_dispatch_time(token_bytes, experts=experts.count, top_k=experts.top_k, ranks=s.ep,
                                          ranks_per_node=per_node, intra=t.nvlink(), inter=t.network())
    return all_to_all_time(token_bytes * experts.top_k, s.ep, t.spread_link(s.ep, per_node))


def _kv_exchange_time(shape: DecoderShape, s: Setup, *, window: int | None, itemsize: int, link: Link) -> float:
    """One exchange of an attention layer's K and V over cp (the forward's, or the backward's gradients): on a
    sliding layer whose window reaches only the previous chunk, the halos from both neighbours at once
    (compiler/parallelize/halo.py), else the all-gather of the sequence's."""
    if s.cp <= 1:
        return 0.0
    if halo_width(window, shape.seq_len // (2 * s.cp)) is not None:
        received = kv_values_received(window=window, seq_len=shape.seq_len, cp=s.cp, batch=s.micro_batch_size,
                                      kv_heads=shape.kv_heads, head_dim=shape.head_dim)
        return link.transfer(received / s.mp * itemsize)
    return all_gather_time(s.micro_batch_size * shape.seq_len * 2 * shape.kv_width / s.mp * itemsize, s.cp, link)


def layer_table(shape: DecoderShape, cluster: Cluster, traits: EngineTraits, s: Setup) -> LayerTable:
    device, topology = cluster.device, cluster.topology
    strides = traits.strides({"dp": s.dp, "pp": s.pp, "cp": s.cp, "mp": s.mp})
    a = PRECISIONS[s.precision].dtype.itemsize
    rows = s.micro_batch_size * shape.seq_len / s.cp
    ranks_on_node = min(topology.devices_per_node, s.dp * s.pp * s.mp * s.cp)
    # FP8 products at the device's FP8 peak (a device without one is refused before: search.py ``fp8_error``)
    linear_peak = device.peak_flops.get("fp8") if traits.float8_linears or s.fp8 else None
    tp_link = topology.group_link(s.mp, strides["mp"])
    one_tp = all_reduce_time(rows * shape.d_model * a, s.mp, tp_link)
    full = s.ac == "full"
    recompute_moe = s.ac == "selective" and traits.recomputes_moe
    out = {}
    for kind in {*shape.kinds(), *shape.mtp_kinds()}:
        work = block_work(shape, kind, micro_batch_size=s.micro_batch_size, mp=s.mp, cp=s.cp, ep=s.ep,
                          precision=s.precision, sequence_parallel=s.sequence_parallel, traits=traits, fp8=s.fp8,
                          cp_gather=s.cp_gather)
        compute = device.compute(work, s.precision, linear_peak=linear_peak, ranks_on_node=ranks_on_node)
        if full:
            compute = ComputeSeconds(compute.forward, compute.backward + compute.forward, compute.memory_bound_forward)
        elif s.ac == "selective":
            matmuls = compute.forward - compute.memory_bound_forward
            again = compute.memory_bound_forward + traits.selective_matmul_recompute * matmuls
            if recompute_moe and mlp_kind(kind) == MOE:  # its memory-bound part is in ``again`` already
                shards = moe_routed_shards(traits, mp=s.mp, sequence_parallel=s.sequence_parallel)
                moe = device.compute(moe_mlp_work(shape, micro_batch_size=s.micro_batch_size, mp=s.mp, cp=s.cp,
                                                  ep=s.ep, precision=s.precision, routed_shards=shards), s.precision,
                                     linear_peak=linear_peak, ranks_on_node=ranks_on_node)
                again += moe.forward - moe.memory_bound_forward
            compute = ComputeSeconds(compute.forward, compute.backward + again, compute.memory_bound_forward)
        tp = (6 if full else 4) * one_tp
        if mlp_kind(kind) == MOE:
            tp /= 2  # attention's collectives only
        if traits.tp_overlap:
            tp = max(0.0, tp - (compute.forward + compute.backward - 3 * compute.memory_bound_forward))
        cp_link = topology.group_link(s.cp, strides["cp"])
        gathered = context_gather(shape.latent, kv_heads=shape.kv_heads, head_dim=shape.head_dim, mp=s.mp,
                                  fp8=bool(s.fp8), choice=s.cp_gather)
        if gathered.gathers == LATENT and s.cp > 1:
            kv_time = all_gather_time(gathered.gathered_bytes(micro_batch_size=s.micro_batch_size,
                                                              seq_len=shape.seq_len, itemsize=a), s.cp, cp_link)
        else:
            window = window_of(kind) if traits.cp_halos else None
            kv_time = _kv_exchange_time(shape, s, window=window, itemsize=a, link=cp_link)
        cp = (3 if full else 2) * kv_time
        ep = 0.0
        if mlp_kind(kind) == MOE:
            tokens = rows / moe_routed_shards(traits, mp=s.mp, sequence_parallel=s.sequence_parallel) * shape.d_model * a
            one = _ep_dispatch_time(cluster, traits, s, strides, token_bytes=tokens, experts=shape.experts)
            ep = (6 if full or recompute_moe else 4) * one
        out[kind] = LayerSeconds(compute, tp, cp, ep)
    embedding = device.compute(embedding_work(shape, micro_batch_size=s.micro_batch_size, cp=s.cp,
                                              precision=s.precision), s.precision, ranks_on_node=ranks_on_node)
    out[EMBEDDING] = LayerSeconds(embedding, one_tp / 2 if s.sequence_parallel else one_tp)
    head = device.compute(head_work(shape, micro_batch_size=s.micro_batch_size, mp=s.mp, cp=s.cp,
                                    precision=s.precision), s.precision, ranks_on_node=ranks_on_node)
    out[HEAD] = LayerSeconds(head, one_tp)
    if shape.mtp_depth:  # each depth on the last stage: its input, its block, the head and loss again
        depth_input = device.compute(mtp_input_work(shape, micro_batch_size=s.micro_batch_size, cp=s.cp,
                                                    precision=s.precision), s.precision, ranks_on_node=ranks_on_node)
        one_depth = LayerSeconds(depth_input, one_tp) + LayerSeconds(head, one_tp)  # the embedding's and head's sums
        out[HEAD] = out[HEAD] + sum((one_depth + out[kind] for kind in shape.mtp_kinds()), ZERO)
    out.setdefault(DENSE, ZERO)
    return LayerTable(out)
