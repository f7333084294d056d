"""A cluster description the planner reasons about: devices, their speed and memory, and links.

Clusters are small JSON files users edit (presets in compiler/clusters/). Two kinds: a CPU machine as
``python run.py calibrate`` measures it (``Cluster``: fitted rates and engine factors), and a GPU node
kind from datasheets (``GpuCluster``, compiler/planner/gpu_cluster.py; its file format is in
compiler/README.md). ``load_cluster`` tells them apart by the GPU format's ``devices_per_node``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from compiler.planner.gpu_cluster import GpuCluster, gpu_cluster_from_dict, is_gpu_cluster_file

PRESET_DIR = Path(__file__).resolve().parent.parent / "clusters"
# Where `run.py calibrate` writes this machine's measurement, and the preset used when there is none
# (a shipped measurement of the machine type this project is developed on).
CALIBRATED = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybrid_engine" / "cluster.json"
LOCAL_PRESET = "cpu-2core"


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction, per rank
    latency: float  # seconds per message

    def transfer(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    ranks_per_node: int  # GPUs per node; on CPU, the ranks we launch per node
    compute_units_per_node: int  # GPUs, or cores: ranks beyond this time-share
    memory_per_node: float  # bytes usable for tensors, shared by the node's ranks
    flops: dict[str, float]  # achievable dense FLOP/s of ONE compute unit, per precision
    intra_node: Link
    inter_node: Link
    # Fixed costs measured on the machine (0 in datasheet presets, where they are negligible):
    layer_overhead: float = 0.0  # seconds per layer per micro-batch (fwd + bwd launch / framework cost)
    step_overhead: float = 0.0  # seconds per training step (optimizer launch, bookkeeping)
    # Fitted by `run.py calibrate` from short engine runs (time_model.py); 1 / 0 in datasheet presets.
    compute_scale: float = 1.0  # engine compute time over the isolated-kernel estimate
    comm_scale: float = 1.0  # engine TP collectives and PP sends over the ring / point-to-point formulas
    dp_comm_scale: float = 1.0  # engine FSDP all-gathers / reduce-scatters over the ring formula
    action_overhead: float = 0.0  # seconds per pipeline action (forward or backward of a stage micro-batch)
    optimizer_bytes_per_s: float = 0.0  # AdamW throughput over parameter bytes (0: ignore)
    source: str = ""
    notes: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def memory_per_rank(self, ranks_per_node: int | None = None) -> float:
        return self.memory_per_node / (ranks_per_node or self.ranks_per_node)

    def rescaled(self, ratio: float, why: str) -> "Cluster":
        """The cluster with every time it prices multiplied by ``ratio`` (rates divided, latencies and fixed
        costs multiplied): the machine measured ``ratio`` times slower (or faster, < 1) than calibrated."""
        def link(x: Link) -> Link:
            return Link(bandwidth=x.bandwidth / ratio, latency=x.latency * ratio)

        return replace(self, flops={p: f / ratio for p, f in self.flops.items()},
                       intra_node=link(self.intra_node), inter_node=link(self.inter_node),
                       layer_overhead=self.layer_overhead * ratio, step_overhead=self.step_overhead * ratio,
                       action_overhead=self.action_overhead * ratio,
                       optimizer_bytes_per_s=self.optimizer_bytes_per_s / ratio,
                       source=f"{self.source}; {why}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_dict(d: dict) -> "Cluster":
        d = dict(d)
        d["intra_node"], d["inter_node"] = Link(**d["intra_node"]), Link(**d["inter_node"])
        return Cluster(**d)


def load_cluster(path_or_name: str) -> Cluster | GpuCluster:
    """A JSON file path, or the name of a preset in compiler/clusters/ (without .json)."""
    path = Path(path_or_name)
    if not path.exists():
        path = PRESET_DIR / f"{path_or_name}.json"
    if not path.exists():
        names = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.json")))
        raise ValueError(f"--cluster {path_or_name}: no such file or preset (presets: {names})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--cluster {path_or_name}: not JSON ({e})") from None
    if is_gpu_cluster_file(data):
        return gpu_cluster_from_dict(data, default_name=path.stem)
    return Cluster.from_dict(data)


# CUDA device names (torch.cuda.get_device_name) -> the preset of their node kind. SXM parts only: a PCIe
# card has another peak, memory bandwidth and no NVSwitch, and would be priced wrong by these presets.
DEVICE_PRESETS = (  # (words the name holds, words it must not hold, preset)
    (("H100", "80GB", "HBM3"), (), "h100-80gb"),  # "NVIDIA H100 80GB HBM3" (SXM5)
    (("H200",), ("NVL",), "h200-141gb"),  # "NVIDIA H200" (SXM); the H200 NVL is a PCIe card
    (("A100", "SXM4", "80GB"), (), "a100-80gb"),  # "NVIDIA A100-SXM4-80GB"
)


def preset_for_device(device_name: str) -> str | None:
    """The preset for a CUDA device name, or None when none matches it."""
    return next((preset for words, unlike, preset in DEVICE_PRESETS
                 if all(w in device_name for w in words) and not any(w in device_name for w in unlike)), None)


def resolve_cluster(name: str | None) -> Cluster | GpuCluster:
    """``--cluster``: a file or preset. By default, on a CUDA machine the preset of its GPU; otherwise this
    machine's calibration, else the local preset."""
    if name:
        return load_cluster(name)
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
        preset = preset_for_device(device)
        if preset is None:
            raise ValueError(f"no cluster preset matches this machine's GPU ({device}); pass --cluster FILE.json "
                             f"(the format is in compiler/README.md; presets: {', '.join(preset_names())})")
        return load_cluster(preset)
    return load_cluster(str(CALIBRATED) if CALIBRATED.exists() else LOCAL_PRESET)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))
