"""A GPU cluster as the planner prices it: one kind of node, repeated as many times as the world needs.

A cluster file is JSON (compiler/README.md documents every key). Required: ``devices_per_node``,
``memory_gib`` (per device), ``peak_tflops`` ({"bf16", "fp16", "fp32"}: dense datasheet peaks per
device), ``intra_node_gb_per_s`` and ``inter_node_gb_per_s`` (per device, one direction, GB/s).
Optional, with the defaults below: ``name``, ``nodes`` (the most nodes there are: a larger world is an
error), ``memory_bandwidth_gb_per_s`` (HBM), latencies, ``link_efficiency``, ``reserved_gib``,
``gemm`` (the achieved-efficiency model, compiler/planner/gpu_time.py), ``source``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRECISION_KEYS = ("bf16", "fp16", "fp32")
REQUIRED = ("devices_per_node", "memory_gib", "peak_tflops", "intra_node_gb_per_s", "inter_node_gb_per_s")


@dataclass(frozen=True)
class GemmEfficiency:
    """Achieved fraction of the dense peak for a matrix product whose reduction dimension is K:
    ``max_efficiency * K / (K + k_half)``: every output tile pays a fixed prologue and epilogue
    besides its K-long main loop, so short reductions (a TP shard's narrow inputs, attention's head
    dimension) reach less of the peak (NVIDIA, Matrix Multiplication Background User's Guide: GEMMs
    with small dimensions are limited by tile and wave quantisation and memory).

    ``k_half`` = 128 is fixed, not fitted: about four 32-deep main-loop iterations of a 128 x 256 tile
    of prologue (filling the shared-memory pipeline) and epilogue (writing the tile). Table 1 barely
    constrains it (fits with k_half from 0 to 600 erred alike). ``max_efficiency`` is fitted to Table 1
    (compiler/planner/reproduce.py); these defaults are the A100 fit, used when a file has no ``gemm``."""
    max_efficiency: float = 0.681
    k_half: float = 128.0

    def efficiency(self, k: float) -> float:
        return self.max_efficiency * k / (k + self.k_half)

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


@dataclass(frozen=True)
class GpuCluster:
    name: str
    devices_per_node: int
    memory_gib: float  # per device
    peak_flops: dict[str, float]  # dense FLOP/s per device, by precision
    intra_node_bandwidth: float  # bytes/s per device, one direction (NVLink / NVSwitch)
    inter_node_bandwidth: float  # bytes/s per device, one direction (its share of the node's NICs)
    nodes: int | None = None  # None: as many as the world needs
    memory_bandwidth: float = 2.0e12  # bytes/s of HBM per device
    intra_node_latency: float = 5e-6  # seconds per collective step / message
    inter_node_latency: float = 10e-6
    # Fraction of a link's rate collectives reach as bus bandwidth on large messages; an assumption
    # (nccl-tests report bus bandwidths somewhat below the link rate), not fitted.
    link_efficiency: float = 0.8
    # Achieved fraction of HBM bandwidth by memory-bound kernels (norms, softmax, element-wise), assumed.
    memory_efficiency: float = 0.8
    # Device memory the tensors cannot use: CUDA context, cuBLAS workspaces, NCCL buffers, and the caching
    # allocator's fragmentation; an assumption (about 1 GiB of context on an H100, the rest margin).
    reserved_gib: float = 3.0
    gemm: GemmEfficiency = field(default_factory=GemmEfficiency)
    source: str = ""

    @property
    def memory_bytes(self) -> float:
        """Bytes per device the planner lets tensors use."""
        return (self.memory_gib - self.reserved_gib) * 2**30

    def nodes_for(self, world: int) -> int:
        return -(-world // self.devices_per_node)

    def world_error(self, world: int) -> str | None:
        """Why this cluster cannot host ``world`` devices (a preset is a kind of node; files may bound the
        node count), or None."""
        if self.nodes is not None and world > self.nodes * self.devices_per_node:
            return (f"--world {world} exceeds the cluster {self.name}: {self.nodes} nodes x {self.devices_per_node} "
                    f"devices = {self.nodes * self.devices_per_node}")
        if world > self.devices_per_node and world % self.devices_per_node:
            return (f"--world {world} must be a multiple of the {self.devices_per_node} devices per node of "
                    f"{self.name} (or at most one node)")
        return None


def is_gpu_cluster_file(data: dict) -> bool:
    return "devices_per_node" in data


def gpu_cluster_from_dict(data: dict, *, default_name: str) -> GpuCluster:
    """Parse the cluster file format; ValueError naming the missing or malformed key."""
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ValueError(f"cluster file {default_name}: missing required key(s) {', '.join(missing)} "
                         f"(required: {', '.join(REQUIRED)})")
    peaks = data["peak_tflops"]
    if not isinstance(peaks, dict) or set(peaks) != set(PRECISION_KEYS):
        raise ValueError(f"cluster file {default_name}: peak_tflops must be an object with the keys "
                         f"{', '.join(PRECISION_KEYS)} (dense TFLOP/s per device), got {peaks!r}")
    gemm = data.get("gemm", {})
    known = set(REQUIRED) | {"name", "nodes", "memory_bandwidth_gb_per_s", "intra_node_latency_us",
                             "inter_node_latency_us", "link_efficiency", "memory_efficiency", "reserved_gib", "gemm",
                             "source", "notes"}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"cluster file {default_name}: unknown key(s) {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(sorted(known))})")
    defaults = GpuCluster("", 1, 1.0, {}, 1.0, 1.0)
    flops = {p: float(v) * 1e12 for p, v in peaks.items()}
    return GpuCluster(
        name=data.get("name", default_name), devices_per_node=int(data["devices_per_node"]),
        memory_gib=float(data["memory_gib"]), peak_flops=flops,
        intra_node_bandwidth=float(data["intra_node_gb_per_s"]) * 1e9,
        inter_node_bandwidth=float(data["inter_node_gb_per_s"]) * 1e9,
        nodes=data.get("nodes"),
        memory_bandwidth=float(data.get("memory_bandwidth_gb_per_s", defaults.memory_bandwidth / 1e9)) * 1e9,
        intra_node_latency=float(data.get("intra_node_latency_us", defaults.intra_node_latency * 1e6)) * 1e-6,
        inter_node_latency=float(data.get("inter_node_latency_us", defaults.inter_node_latency * 1e6)) * 1e-6,
        link_efficiency=float(data.get("link_efficiency", defaults.link_efficiency)),
        memory_efficiency=float(data.get("memory_efficiency", defaults.memory_efficiency)),
        reserved_gib=float(data.get("reserved_gib", defaults.reserved_gib)),
        gemm=GemmEfficiency(**{k: float(v) for k, v in gemm.items() if k in ("max_efficiency", "k_half")}),
        source=data.get("source", ""))
