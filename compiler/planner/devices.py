"""The device part of the cost model: how long one rank takes for one layer's work, and what it holds.

A layer's work is device-independent (``LayerWork``, compiler/planner/work.py builds it from the shape
and the plan); a device prices it. Two implementations of one protocol:

- ``CpuDevice``, this machine as ``run.py calibrate`` measured it: the layer's FLOPs (in torch's
  FlopCounterMode convention, what the calibration's block benchmark was fitted to) at the achieved block
  rate of the precision, plus a fixed cost per layer and micro-batch; ranks beyond the cores time-share
  them (compute slows by ranks x busy fraction / cores when that exceeds 1) and fewer ranks than cores
  run cores // ranks threads each. Communication and compute share the cores: DP collectives do not hide.
- ``GpuDevice``, a GEMM/HBM roofline: every linear layer runs three products (forward, input and weight
  gradient), each at ``GemmEfficiency`` of its reduction length (a grouped product of experts also at the
  fraction its rows per expert reach); attention with FlashAttention (causal half, backward 2.5x, no T x T
  scores in HBM) or materialised (Megatron-LM 2021: batched products plus the scores through HBM at about
  9 bytes per score forward, 11 backward); memory-bound kernels at the HBM rate (backward moves twice the
  forward's bytes).

Both answer ``compute(work, precision)`` -> ``ComputeSeconds``; the recompute of activation checkpointing
reuses its parts (full: the forward again; selective: the memory-bound forward again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from compiler.precisions import PRECISIONS


@dataclass(frozen=True)
class Gemm:
    """A forward matrix product [m, k] x [k, n]; ``groups`` equal products (a grouped GEMM over experts)."""
    m: float
    n: float
    k: float
    groups: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.groups


@dataclass(frozen=True)
class LayerWork:
    """One layer's work for one micro-batch on one rank."""
    gemms: tuple[Gemm, ...] = ()
    grouped: tuple[Gemm, ...] = ()  # experts' products: a grouped GEMM of ``groups`` experts, m rows each
    attention_flops: float = 0.0  # forward FLOPs of QK^T and AV actually run (causal half with flash)
    attention_head_dim: int = 64
    attention_keys: int = 0  # the sequence length T the keys span (the CPU's attention rate depends on it)
    attention_kernel: str = "flash"  # "flash" (FlashAttention-2, SDPA) | "fused" (cuDNN's, engines.py ``attention``)
    scores: float = 0.0  # T x T scores through HBM (materialised attention), per micro-batch on this rank
    elementwise_bytes: float = 0.0  # forward bytes through memory-bound kernels (norms, activations, adds, loss)
    counted_flops: float = 0.0  # forward + backward in FlopCounterMode's convention (what the CPU rate measures)
    counted_forward_flops: float = 0.0
    tensor_parallel_modules: int = 0  # mp > 1: the block's DTensor modules (shape.py ``tensor_parallel_modules``)
    quantize_bytes: tuple[float, float] = (0.0, 0.0)  # --fp8: (forward, backward) bytes the quantizers move (work.py)


@dataclass(frozen=True)
class ComputeSeconds:
    forward: float
    backward: float
    memory_bound_forward: float  # the part of ``forward`` selective recompute runs again

    def __add__(self, other: "ComputeSeconds") -> "ComputeSeconds":
        return ComputeSeconds(self.forward + other.forward, self.backward + other.backward,
                              self.memory_bound_forward + other.memory_bound_forward)

    def scaled(self, x: float) -> "ComputeSeconds":
        return ComputeSeconds(self.forward * x, self.backward * x, self.memory_bound_forward * x)


@dataclass(frozen=True)
class GemmEfficiency:
    """Achieved fraction of the dense peak for a matrix product whose reduction dimension is K:
    ``max_efficiency * K / (K + k_half)``: every output tile pays a fixed prologue and epilogue besides its
    K-long main loop, so short reductions (a TP shard's narrow inputs, attention's head dimension) reach less
    of the peak (NVIDIA, Matrix Multiplication Background User's Guide: GEMMs with small dimensions are
    limited by tile and wave quantisation and memory). A grouped product with m rows per group also reaches
    only m / (m + k_half) of that: few tokens per expert leave most of a tile empty.

    ``k_half`` = 128 is fixed, not fitted: about four 32-deep main-loop iterations of a 128 x 256 tile of
    prologue and epilogue. ``max_efficiency`` is fitted to Table 1 of Narayanan et al. SC'21
    (compiler/planner/reproduce.py); these defaults are that A100 fit, used when a file has no ``gemm``."""
    max_efficiency: float = 0.68
    k_half: float = 128.0

    def efficiency(self, k: float) -> float:
        return self.max_efficiency * k / (k + self.k_half)

    def rows(self, m: float) -> float:
        return m / (m + self.k_half)

    @staticmethod
    def fit(points: list[tuple[float, float]]) -> "GemmEfficiency":
        """The curve through measured (K, achieved fraction of peak) points, e.g. GEMMs timed on a lent GPU:
        1 / e = 1 / max + (k_half / max) / K is a line in 1 / K, fitted by least squares."""
        if len({k for k, _ in points}) < 2:
            raise ValueError("fitting the GEMM efficiency needs measurements at two or more reduction lengths")
        xs, ys = [1 / k for k, _ in points], [1 / e for _, e in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        intercept = my - slope * mx
        return GemmEfficiency(max_efficiency=1 / intercept, k_half=slope / intercept)


def rows_aligned(length: float, itemsize: int) -> bool:
    """Whether a matrix row of ``length`` values of ``itemsize`` bytes is a multiple of 16 bytes, as cuBLAS's
    tensor-core kernels need of every operand's rows (else it falls back to unaligned kernels; ``GpuDevice``)."""
    return length * itemsize % 16 == 0


@dataclass(frozen=True)
class GpuDevice:
    memory_gib: float
    peak_flops: dict[str, float]  # dense FLOP/s per device, by precision ("fp8": optional, for Float8 linears)
    memory_bandwidth: float = 2.0e12  # bytes/s of HBM
    memory_efficiency: float = 0.8  # achieved fraction of HBM bandwidth by memory-bound kernels (assumed)
    # Memory tensors cannot use: CUDA context, cuBLAS workspaces, NCCL buffers, the caching allocator's
    # fragmentation; an assumption (about 1 GiB of context on an H100, the rest margin).
    reserved_gib: float = 3.0
    gemm: GemmEfficiency = field(default_factory=GemmEfficiency)
    kind: str = "gpu"
    dp_overlap: bool = True  # collectives run on their own streams beside compute
    tp_buffers_per_block: int = 0  # DTensor's extra [B, T, d] fp32 buffers were measured on CPU only
    reduce_scatter_copies_input: bool = False  # NCCL reduce-scatters in place (memory_model.py ``reduce_memory``)
    # cuBLASLt's FP8 GEMM dequantizes nothing to memory (devices.CpuDevice's copies); not measured on a GPU
    fp8_product_bytes_per_weight: int = 0
    # A product whose matrices' rows are not a multiple of 16 bytes (GPT-2's 50,257-word head in bf16) runs on
    # cuBLAS's unaligned kernels (a Turing-era cutlass_75 align1 kernel on Hopper). The factor below is measured on an
    # H200 in bf16 (README results: GPT-2's unaligned head); the alignment rule is cuBLAS's, in bytes, for every dtype.
    unaligned_slowdown: float = 15.59 / 2.61
    # Transformer Engine's attention on Hopper+ is cuDNN's fused kernel (TE prefers it to FlashAttention-2 there,
    # dot_product_attention/utils.py ``get_attention_backend``): (forward, backward) speed over FlashAttention-2 on
    # this device, where measured (the cluster file's ``fused_attention_speedup``); None: priced as flash.
    fused_attention_speedup: tuple[float, float] | None = None

    def memory_per_rank(self, ranks_on_node: int) -> float:
        return (self.memory_gib - self.reserved_gib) * 2**30

    def peak(self, precision: str) -> float:
        return self.peak_flops[precision]

    def sharing(self, *, ranks_on_node: int, busy: float) -> float:
        return 1.0  # one rank per device

    def _products(self, g: Gemm, peak: float, grouped: bool, *, itemsize: int) -> tuple[float, float]:
        """(forward, backward) seconds: forward reduces over k, the input gradient over n, the weight gradient over m.
        The rows of x [m, k], of the weight [n, k] and of the output [m, n] are k and n values long; all three
        products read or write them, so either one off a 16-byte multiple slows all three."""
        e, rows = self.gemm.efficiency, self.gemm.rows(g.m) if grouped else 1.0
        aligned = rows_aligned(g.n, itemsize) and rows_aligned(g.k, itemsize)
        peak = peak if aligned else peak / self.unaligned_slowdown
        return g.flops / (peak * e(g.k) * rows), g.flops / (peak * e(g.n) * rows) + g.flops / (peak * e(g.m))

    def memory_seconds(self, nbytes: float) -> float:
        return nbytes / (self.memory_bandwidth * self.memory_efficiency)

    def compute(self, work: LayerWork, precision: str, *, linear_peak: float | None = None,
                ranks_on_node: int = 1) -> ComputeSeconds:
        peak = self.peak_flops[precision]
        itemsize = PRECISIONS[precision].dtype.itemsize
        fwd = bwd = 0.0
        for g in work.gemms:
            f, b = self._products(g, linear_peak or peak, False, itemsize=itemsize)
            fwd, bwd = fwd + f, bwd + b
        for g in work.grouped:
            f, b = self._products(g, linear_peak or peak, True, itemsize=itemsize)
            fwd, bwd = fwd + f, bwd + b
        if work.attention_flops:
            e = self.gemm.efficiency(work.attention_head_dim)
            fused = work.attention_kernel == "fused" and self.fused_attention_speedup
            up_f, up_b = fused or (1.0, 1.0)
            fwd += work.attention_flops / (peak * e * up_f)
            bwd += 2.5 * work.attention_flops / (peak * e * up_b)
        other = self.memory_seconds(work.elementwise_bytes + 9 * work.scores + work.quantize_bytes[0])
        backward_other = self.memory_seconds(2 * work.elementwise_bytes + 11 * work.scores + work.quantize_bytes[1])
        return ComputeSeconds(fwd + other, bwd + backward_other, other)

    def optimizer_seconds(self, params: float) -> float:
        """AdamW over fp32 shards: 32 bytes per parameter through HBM (read parameter, gradient and two moments,
        write three; the gradient norm reads the gradient again)."""
        return self.memory_seconds(32 * params)


@dataclass(frozen=True)
class CpuDevice:
    flops: dict[str, float]  # achieved block FLOP/s of ONE core per precision (calibrated)
    peak_flops: dict[str, float]  # best dense matmul FLOP/s of one core (MFU's denominator)
    units_per_node: int  # cores: ranks beyond them time-share
    memory_per_node: float  # bytes usable for tensors, shared by the node's ranks
    layer_overhead: float = 0.0  # seconds per layer and micro-batch (forward + backward launch / framework)
    optimizer_bytes_per_s: float = 0.0  # AdamW throughput over fp32 parameter bytes (0: ignore)
    kind: str = "cpu"
    dp_overlap: bool = False  # gloo and compute share the cores
    # mp > 1: DTensor's redistributions keep two full [B, T, d] fp32 buffers per block and in-flight
    # micro-batch beyond the saved tensors (measured here: 4 blocks, d 128, T 64; memory_model.py).
    tp_buffers_per_block: int = 2
    reduce_scatter_copies_input: bool = True  # gloo all-reduces a clone of it (memory_model.py ``reduce_memory``)
    # A Float8 linear's backward on this CPU, per element of the block's largest Float8 weight (W, N x K): torch's
    # CPU ``_scaled_mm`` dequantizes its operands to fp32 and scales them (4 + 4 bytes of W in the input-gradient
    # product), kernels.py lays W's FP8 bytes out column-major and the CPU kernel copies them once more (1 + 1),
    # and the previous linear's bf16 weight gradient waits for its accumulation (2). Measured (2 ranks, d 512,
    # T 32, tensorwise): 12.3 MiB of a 2048 x 512 weight at the backward's peak, one byte more where the backward
    # quantizes W itself (not gathered in FP8).
    fp8_product_bytes_per_weight: int = 12
    # Causal flash attention's FLOP/s of one core, forward + backward over the FLOPs it runs, per precision:
    # ((T, head_dim, rate), ...) measured by calibrate. It is not the block rate: the CPU kernel's tiles are small
    # matrix products plus a softmax (measured here, bf16: 22 GFLOP/s at T 512 and 65 at T 8192, head dim 32,
    # against 158 on blocks). None (or a precision without points): the block rate.
    attention_points: dict[str, tuple[tuple[float, float, float], ...]] | None = None
    # A mixture-of-experts layer's own block rate and fixed cost (router, top-k, token sort, one product per
    # expert), fitted by calibrate as the dense block's are; None: priced as a dense block.
    moe_flops: dict[str, float] | None = None
    moe_layer_overhead: dict[str, float] | None = None  # per precision: autocast's cost per small op adds up here
    # Per precision: seconds per micro-batch (forward + backward) that each tensor-parallel module of a block
    # adds in DTensor's Python dispatch (sharding propagation, placement conversions at its boundaries),
    # collectives apart. Measured by calibrate (a block on a one-rank mesh against the plain block): about 0.7-1.3
    # ms here against the whole block's 0.44 ms fixed cost, so tiny TP plans ran 1.5-2.6x a price without it.
    # None: not measured (0).
    tp_module_overhead: dict[str, float] | None = None

    def memory_per_rank(self, ranks_on_node: int) -> float:
        return self.memory_per_node / ranks_on_node

    def peak(self, precision: str) -> float:
        return self.peak_flops.get(precision, self.flops[precision])

    def threads(self, ranks_on_node: int) -> int:
        """Fewer ranks than cores run cores // ranks threads each (runtime/device.py)."""
        return max(1, self.units_per_node // ranks_on_node)

    def rate(self, precision: str, *, ranks_on_node: int, experts: bool = False) -> float:
        """FLOP/s one rank reaches on blocks (``experts``: mixture-of-experts blocks, where calibrated)."""
        table = self.moe_flops if experts and self.moe_flops and precision in self.moe_flops else self.flops
        return table[precision] * self.threads(ranks_on_node)

    def with_rates(self, factor) -> "CpuDevice":
        """Every calibrated rate of precision p (blocks, MoE blocks, attention) multiplied by ``factor(p)``."""
        def scaled(table):
            return {p: v * factor(p) for p, v in table.items()} if table else table
        points = ({p: tuple((t, hd, r * factor(p)) for t, hd, r in pts) for p, pts in self.attention_points.items()}
                  if self.attention_points else self.attention_points)
        return replace(self, flops=scaled(self.flops), moe_flops=scaled(self.moe_flops), attention_points=points)

    def attention_rate(self, precision: str, *, keys: int, head_dim: int, ranks_on_node: int) -> float:
        """FLOP/s one rank reaches on causal attention over ``keys`` tokens: the calibrated points interpolated
        linearly in log T and log head_dim (clamped to the measured range); the block rate without points."""
        points = (self.attention_points or {}).get(precision)
        if not points or keys <= 0:
            return self.rate(precision, ranks_on_node=ranks_on_node)
        return self.threads(ranks_on_node) * _log_bilinear(points, float(keys), float(head_dim))

    def sharing(self, *, ranks_on_node: int, busy: float) -> float:
        """Compute slowdown when the ranks computing at once outnumber the cores."""
        return max(1.0, ranks_on_node * busy / self.units_per_node)

    def compute(self, work: LayerWork, precision: str, *, linear_peak: float | None = None,
                ranks_on_node: int = 1) -> ComputeSeconds:
        experts = bool(work.grouped)  # a mixture-of-experts layer: its own calibrated rate and fixed cost
        rate = self.rate(precision, ranks_on_node=ranks_on_node, experts=experts)
        overhead = (self.moe_layer_overhead or {}).get(precision, self.layer_overhead) if experts else self.layer_overhead
        # FlopCounterMode counts attention's whole T x T (forward 2a, backward 5a, where a = work.attention_flops
        # is the causal half the CPU flash kernel runs forward; its backward runs 2.5a). At T 8192 attention is
        # ~87% of a 4 x d 256 Llama block's counted FLOPs: counting the half it skips priced cp runs at 1.6-2.4x
        # their time. The half it runs goes at the attention rate, the rest of the block at the block rate.
        a = work.attention_flops
        attention = self.attention_rate(precision, keys=work.attention_keys, head_dim=work.attention_head_dim,
                                        ranks_on_node=ranks_on_node)
        forward = (work.counted_forward_flops - 2 * a) / rate + a / attention
        overhead += work.tensor_parallel_modules * (self.tp_module_overhead or {}).get(precision, 0.0)
        backward = ((work.counted_flops - work.counted_forward_flops - 5 * a) / rate + 2.5 * a / attention
                    + overhead)
        return ComputeSeconds(forward, backward, 0.0)

    def optimizer_seconds(self, params: float) -> float:
        return params * 4 / self.optimizer_bytes_per_s if self.optimizer_bytes_per_s else 0.0


def _log_bilinear(points: tuple[tuple[float, float, float], ...], t: float, hd: float) -> float:
    """Rate at (t, hd) from (T, head_dim, rate) points on a grid: linear in log T within each measured head
    dim, then linear in log head_dim between the two nearest; clamped outside the measured range."""
    def along(pairs: list[tuple[float, float]], x: float) -> float:
        pairs = sorted(pairs)
        if x <= pairs[0][0]:
            return pairs[0][1]
        for (x0, y0), (x1, y1) in zip(pairs, pairs[1:]):
            if x <= x1:
                w = math.log(x / x0) / math.log(x1 / x0)
                return y0 + w * (y1 - y0)
        return pairs[-1][1]

    dims = sorted({d for _, d, _ in points})
    by_dim = [(d, along([(T, r) for T, dd, r in points if dd == d], t)) for d in dims]
    return by_dim[0][1] if len(by_dim) == 1 else along(by_dim, hd)
