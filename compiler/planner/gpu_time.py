"""Seconds of one layer's work on one GPU, from the shape alone: matrix products at an achieved
efficiency, memory-bound kernels at the HBM rate, tensor-parallel collectives on the node's links.

Per block and micro-batch of b sequences of T tokens on one of t TP ranks (M = b T rows):
- every linear layer [M, K] x [K, N] runs three products of 2MNK FLOPs: forward (reduction over K),
  input gradient (over N) and weight gradient (over M), each at ``GemmEfficiency.efficiency`` of its
  reduction length (compiler/planner/gpu_cluster.py); activation checkpointing runs forward twice;
- attention, per sequence and head: with FlashAttention (Dao 2022; SDPA on GPU, what the engine runs)
  causal masking skips half of QK^T and AV, backward is 2.5x forward (it recomputes the scores), and no
  T x T matrix touches HBM; "materialized" attention (Megatron-LM 2021, before FlashAttention) runs QK^T
  and AV as batched products over the head dimension and the T x T scores through a fused
  scale-mask-softmax and dropout: about 9 bytes per score forward (read and write fp16 scores and
  probabilities, a one-byte dropout mask) and 11 backward;
- memory-bound kernels (norms, residual adds, bias + GELU or SiLU x up, RoPE, the q/k/v transposes):
  per token forward about 10 d values of the residual stream (two norms read and write it, two residual
  adds read two and write one) plus 2 (q + 2kv) / t and 2 q / t for the attention's reshapes and 2 f / t
  (GELU) or 3 f / t (SwiGLU), each moved at the compute dtype's width; backward moves twice that;
- tensor parallelism all-reduces [b, T, d] twice forward and twice backward (Megatron-LM's f and g;
  with sequence parallelism an all-gather and a reduce-scatter of the same volume, Korthikanti et al.
  2022), and twice more when the forward is recomputed; ring all-reduce 2 (t-1)/t S / bandwidth.
The LM head is one [M, d] x [d, V/t] product plus its softmax over fp32 logits; its input gradient is
all-reduced, as is the vocabulary-parallel embedding's output.
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler.planner.gpu_cluster import GpuCluster
from compiler.planner.shape import DecoderShape, _block_matrices
from compiler.precisions import PRECISIONS


@dataclass(frozen=True)
class EngineTraits:
    """What the priced engine does where engines differ (the planner prices this engine by default)."""
    attention: str = "flash"  # "flash" | "materialized" (T x T scores in HBM)
    p2p_scatter_gather: bool = False  # pipeline messages split over the TP ranks (Megatron's scatter/gather)
    dp_overlap: bool = True  # gradient reduction overlaps the backward of the last micro-batch
    grad_reduce_bytes: int = 4  # data-parallel gradients travel in fp32 (--reduce-dtype fp32) or 2 bytes
    sequence_parallel: bool = False  # norms and residuals sharded over the sequence when mp > 1


# Narayanan et al. 2021 (SC'21, Megatron-LM): materialised attention with a fused softmax kernel, the
# scatter/gather optimisation of pipeline messages (sec. 4.1), the data-parallel all-reduce after the
# backward pass, and fp16 gradients (Megatron-LM's --accumulate-allreduce-grads-in-fp32 was off by default).
MEGATRON_2021 = EngineTraits(attention="materialized", p2p_scatter_gather=True, dp_overlap=False, grad_reduce_bytes=2)


@dataclass(frozen=True)
class LayerSeconds:
    """One micro-batch through one layer on one GPU."""
    forward: float  # compute and memory-bound kernels
    backward: float  # including the recomputed forward under activation checkpointing
    tp: float  # tensor-parallel collectives, forward + backward (+ recompute)


def _gemm(m: float, n: float, k: float, cluster: GpuCluster, peak: float) -> tuple[float, float]:
    """(forward, backward) seconds of [m, k] x [k, n]: forward reduces over k, the input gradient over n,
    the weight gradient over m."""
    flops = 2.0 * m * n * k
    e = cluster.gemm.efficiency
    return flops / (peak * e(k)), flops / (peak * e(n)) + flops / (peak * e(m))


def _memory(nbytes: float, cluster: GpuCluster) -> float:
    return nbytes / (cluster.memory_bandwidth * cluster.memory_efficiency)


def all_reduce_seconds(nbytes: float, n: int, *, bandwidth: float, latency: float) -> float:
    """Ring all-reduce (Patarasuk and Yuan 2009): 2 (n-1)/n S / bandwidth + 2 (n-1) latency."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def all_gather_seconds(nbytes: float, n: int, *, bandwidth: float, latency: float) -> float:
    """Ring all-gather or reduce-scatter of ``nbytes`` in total: half an all-reduce."""
    return all_reduce_seconds(nbytes, n, bandwidth=bandwidth, latency=latency) / 2


def tp_link(cluster: GpuCluster, mp: int) -> tuple[float, float]:
    """(bandwidth, latency) of a TP group of ``mp`` consecutive ranks: NVLink inside a node."""
    if mp <= cluster.devices_per_node:
        return cluster.intra_node_bandwidth * cluster.link_efficiency, cluster.intra_node_latency
    return cluster.inter_node_bandwidth * cluster.link_efficiency, cluster.inter_node_latency


def block_seconds(shape: DecoderShape, cluster: GpuCluster, traits: EngineTraits, *, micro_batch_size: int,
                  mp: int, precision: str, activation_checkpointing: bool) -> LayerSeconds:
    peak = cluster.peak_flops[precision]
    a = PRECISIONS[precision].dtype.itemsize
    b, T, d, t = micro_batch_size, shape.seq_len, shape.d_model, mp
    rows = b * T
    fwd = bwd = 0.0
    for k, n in _block_matrices(shape, mp).values():
        f, g = _gemm(rows, n, k, cluster, peak)
        fwd, bwd = fwd + f, bwd + g
    heads, hd = shape.heads // t, shape.head_dim
    if traits.attention == "flash":
        flops = 4.0 * b * heads * T * T * hd / 2  # causal: half the score blocks
        e = cluster.gemm.efficiency(hd)
        fwd, bwd = fwd + flops / (peak * e), bwd + 2.5 * flops / (peak * e)
    else:
        for m_, n_, k_ in ((T, T, hd), (T, hd, T)):  # QK^T, then probabilities x V
            f, g = _gemm(m_, n_, k_, cluster, peak)
            fwd, bwd = fwd + b * heads * f, bwd + b * heads * g
        scores = b * heads * T * T
        fwd, bwd = fwd + _memory(9 * scores, cluster), bwd + _memory(11 * scores, cluster)
    replicated = 10 * d / (t if traits.sequence_parallel else 1)
    split = 2 * (shape.q_width + 2 * shape.kv_width) / t + 2 * shape.q_width / t
    split += (3 if shape.mlp == "swiglu" else 2) * shape.mlp_width / t
    elementwise = _memory(rows * (replicated + split) * a, cluster)
    fwd, bwd = fwd + elementwise, bwd + 2 * elementwise
    bandwidth, latency = tp_link(cluster, t)
    one = all_reduce_seconds(rows * d * a, t, bandwidth=bandwidth, latency=latency)
    if activation_checkpointing:
        bwd += fwd
    return LayerSeconds(fwd, bwd, (6 if activation_checkpointing else 4) * one)


def head_seconds(shape: DecoderShape, cluster: GpuCluster, *, micro_batch_size: int, mp: int,
                 precision: str) -> LayerSeconds:
    """Final norm, LM head and cross-entropy over the vocabulary shard (the loss on sharded logits)."""
    peak = cluster.peak_flops[precision]
    a = PRECISIONS[precision].dtype.itemsize
    rows, d = micro_batch_size * shape.seq_len, shape.d_model
    vocab = -(-shape.vocab_size // mp)
    fwd, bwd = _gemm(rows, vocab, d, cluster, peak)
    # Logits written at a bytes, read and written as fp32 by the softmax forward and backward.
    logits = _memory(rows * vocab * (2 * a + 12), cluster) + _memory(rows * d * 4 * a, cluster)
    bandwidth, latency = tp_link(cluster, mp)
    tp = all_reduce_seconds(rows * d * a, mp, bandwidth=bandwidth, latency=latency)
    return LayerSeconds(fwd + logits / 3, bwd + 2 * logits / 3, tp)


def embedding_seconds(shape: DecoderShape, cluster: GpuCluster, *, micro_batch_size: int, mp: int,
                      precision: str) -> LayerSeconds:
    """A gather of rows (memory-bound) and, over the vocabulary shards, the all-reduce of its output."""
    a = PRECISIONS[precision].dtype.itemsize
    rows, d = micro_batch_size * shape.seq_len, shape.d_model
    move = _memory(rows * d * (a + 4), cluster)
    bandwidth, latency = tp_link(cluster, mp)
    return LayerSeconds(move, 2 * move, all_reduce_seconds(rows * d * a, mp, bandwidth=bandwidth, latency=latency))
