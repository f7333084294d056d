"""A cluster as the planner prices it: a device (compiler/planner/devices.py), the topology that links the
devices (compiler/planner/collectives.py) and the engine factors fitted to measured runs (``EngineFactors``).

Clusters are small JSON files users edit (presets in compiler/clusters/), in two formats that load into
the same ``Cluster``:
- a CPU machine as ``python run.py calibrate`` measured it (``ranks_per_node``, ``flops``, ``intra_node``
  ...: the achieved block rates, the fixed costs and the gloo link it fitted);
- a GPU node kind from datasheets (``devices_per_node``, ``memory_gib``, ``peak_tflops``, link rates: the
  format compiler/README.md documents), repeated as many times as the world needs.
Either may carry fitted engine factors (``compute_scale`` ... ``step_overhead``): ``run.py calibrate``
fits them on this CPU, ``run.py calibrate --measured FILE`` to GPU runs (tests/gpu/gpu_check.sh's output).
A CPU file may also hold factors fitted at several worlds (``engine_factors_by_world``): ranks that share
cores slow gloo's collectives and the per-step work more than the kernels' sharing accounts for (on this
2-core machine the TP / PP factor is 1.8 at 4 ranks, 5.1 at 8), so a plan is priced with the factors
fitted at the world nearest its own (``Cluster.factors_for``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from compiler.planner.collectives import Link, Topology
from compiler.planner.devices import CpuDevice, GemmEfficiency, GpuDevice

PRESET_DIR = Path(__file__).resolve().parent.parent / "clusters"
# Where `run.py calibrate` writes this machine's measurement, and the preset used when there is none
# (a shipped measurement of the machine type this project is developed on).
CALIBRATED = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybrid_engine" / "cluster.json"
LOCAL_PRESET = "cpu-2core"


@dataclass(frozen=True)
class EngineFactors:
    """Turn the isolated prices of kernels and collectives into engine step times (fitted, compiler/planner/fit.py):

        step = compute_scale x compute + comm_scale x (TP + CP + EP + PP) + dp_comm_scale x DP
               + action_overhead x actions + optimizer + step_overhead
    """
    compute_scale: float = 1.0
    comm_scale: float = 1.0
    dp_comm_scale: float = 1.0
    action_overhead: float = 0.0  # seconds per pipeline action (forward or backward of a stage micro-batch)
    step_overhead: float = 0.0  # seconds per step (optimizer launch, loss and norm reductions, bookkeeping)


FACTOR_NAMES = tuple(f.name for f in fields(EngineFactors))


@dataclass(frozen=True)
class Cluster:
    name: str
    device: CpuDevice | GpuDevice
    topology: Topology
    factors: EngineFactors = field(default_factory=EngineFactors)
    source: str = ""
    notes: dict = field(default_factory=dict)
    # CPU: factors fitted on engine runs at each of these worlds (run.py calibrate --engine-world N); empty:
    # ``factors`` at every world.
    factors_by_world: dict[int, EngineFactors] = field(default_factory=dict)

    @property
    def is_gpu(self) -> bool:
        return self.device.kind == "gpu"

    @property
    def devices_per_node(self) -> int:
        return self.topology.devices_per_node

    def memory_per_rank(self, world: int) -> float:
        return self.device.memory_per_rank(min(world, self.topology.devices_per_node))

    def world_error(self, world: int) -> str | None:
        return self.topology.world_error(world, self.name)

    def factors_for(self, world: int) -> EngineFactors:
        """The factors fitted at the world nearest ``world`` (by ratio; a tie goes to the larger world, the
        more shared cores), or ``factors`` when none were fitted per world."""
        if not self.factors_by_world:
            return self.factors
        nearest = min(self.factors_by_world, key=lambda w: (abs(math.log(world / w)), -w))
        return self.factors_by_world[nearest]

    def with_factors(self, **factors: float) -> "Cluster":
        """These factors at every world (a per-world table is dropped: a fit to runs supersedes it)."""
        return replace(self, factors=replace(self.factors, **factors), factors_by_world={})

    def rescaled(self, ratio: float, why: str) -> "Cluster":
        """Every time it prices multiplied by ``ratio`` (rates divided, latencies and fixed costs multiplied):
        the machine measured ``ratio`` times slower (or faster, < 1) than calibrated (CPU clusters)."""
        def link(x: Link) -> Link:
            return replace(x, bandwidth=x.bandwidth / ratio, latency=x.latency * ratio)

        def longer(seconds: dict[str, float] | None) -> dict[str, float] | None:
            return {p: s * ratio for p, s in seconds.items()} if seconds else None

        d = self.device
        device = replace(d.with_rates(lambda p: 1 / ratio), layer_overhead=d.layer_overhead * ratio,
                         optimizer_bytes_per_s=d.optimizer_bytes_per_s / ratio,
                         moe_layer_overhead=longer(d.moe_layer_overhead),
                         tp_module_overhead=longer(d.tp_module_overhead))
        def slower(f: EngineFactors) -> EngineFactors:
            return replace(f, action_overhead=f.action_overhead * ratio, step_overhead=f.step_overhead * ratio)

        return replace(self, device=device, topology=replace(self.topology, intra=link(self.topology.intra),
                                                              inter=link(self.topology.inter)),
                       factors=slower(self.factors), factors_by_world={w: slower(f) for w, f in
                                                                       self.factors_by_world.items()},
                       source=f"{self.source}; {why}")

    def with_precision_rates(self, ratios: dict[str, float], line: str) -> "Cluster":
        """A CPU cluster with each precision's block rate and matmul peak scaled (compiler/planner/precision_probe.py)."""
        d = self.device
        device = replace(d.with_rates(lambda p: ratios.get(p, 1.0)),
                         peak_flops={p: v * ratios.get(p, 1.0) for p, v in d.peak_flops.items()})
        return replace(self, device=device, source=f"{self.source}; {line}")

    def to_json(self) -> str:
        """The file format it was read from (CPU: calibrate's; GPU: compiler/README.md's), factors included."""
        return json.dumps(cpu_file(self) if not self.is_gpu else gpu_file(self), indent=2)


# --- the CPU format (run.py calibrate) -----------------------------------------------------------------

def cpu_cluster_from_dict(d: dict) -> Cluster:
    intra, inter = Link(**d["intra_node"]), Link(**d["inter_node"])
    notes = d.get("notes", {})
    device = CpuDevice(flops=dict(d["flops"]), peak_flops=dict(notes.get("peak_flops", d["flops"])),
                       units_per_node=int(d["compute_units_per_node"]), memory_per_node=float(d["memory_per_node"]),
                       layer_overhead=float(d.get("layer_overhead", 0.0)),
                       optimizer_bytes_per_s=float(d.get("optimizer_bytes_per_s", 0.0)),
                       attention_points={p: tuple((float(t), float(hd), float(r)) for t, hd, r in pts)
                                         for p, pts in d["attention_flops"].items()} if "attention_flops" in d else None,
                       moe_flops=_by_precision(d, "moe_flops"),
                       moe_layer_overhead=_by_precision(d, "moe_layer_overhead"),
                       tp_module_overhead=_by_precision(d, "tp_module_overhead"))
    factors = EngineFactors(**{k: float(d[k]) for k in FACTOR_NAMES if k in d})
    return Cluster(d["name"], device, Topology(int(d["ranks_per_node"]), intra, inter), factors,
                   d.get("source", ""), notes, _factors_by_world(d.get("engine_factors_by_world", {})))


def _by_precision(d: dict, key: str) -> dict[str, float] | None:
    """An optional ``{precision: value}`` table of a CPU file; None where the file has none."""
    return {p: float(v) for p, v in d[key].items()} if key in d else None


def _factors_by_world(table: dict) -> dict[int, EngineFactors]:
    """``{"4": {"compute_scale": ...}, ...}`` -> {4: EngineFactors}; ValueError naming what is malformed."""
    out = {}
    for world, factors in table.items():
        if not (str(world).isdigit() and int(world) >= 1 and isinstance(factors, dict)
                and set(factors) == set(FACTOR_NAMES)
                and all(isinstance(v, (int, float)) and v >= 0 for v in factors.values())):
            raise ValueError(f"engine_factors_by_world {world!r}: a world (a positive integer) with the "
                             f"non-negative factors {', '.join(FACTOR_NAMES)}, got {factors!r}")
        out[int(world)] = EngineFactors(**{k: float(v) for k, v in factors.items()})
    return out


def cpu_file(c: Cluster) -> dict:
    d = c.device
    return {"name": c.name, "nodes": 1, "ranks_per_node": c.topology.devices_per_node,
            "compute_units_per_node": d.units_per_node, "memory_per_node": d.memory_per_node, "flops": d.flops,
            "intra_node": {"bandwidth": c.topology.intra.bandwidth, "latency": c.topology.intra.latency},
            "inter_node": {"bandwidth": c.topology.inter.bandwidth, "latency": c.topology.inter.latency},
            "layer_overhead": d.layer_overhead, **asdict(c.factors), "optimizer_bytes_per_s": d.optimizer_bytes_per_s,
            **({"attention_flops": {p: [list(x) for x in pts] for p, pts in d.attention_points.items()}}
               if d.attention_points else {}),
            **({"moe_flops": d.moe_flops, "moe_layer_overhead": d.moe_layer_overhead} if d.moe_flops else {}),
            **({"tp_module_overhead": d.tp_module_overhead} if d.tp_module_overhead else {}),
            **({"engine_factors_by_world": {str(w): asdict(f) for w, f in sorted(c.factors_by_world.items())}}
               if c.factors_by_world else {}),
            "source": c.source, "notes": {**c.notes, "peak_flops": d.peak_flops}}


# --- the GPU format (compiler/README.md) -----------------------------------------------------------------

PRECISION_KEYS = ("bf16", "fp16", "fp32")
REQUIRED = ("devices_per_node", "memory_gib", "peak_tflops", "intra_node_gb_per_s", "inter_node_gb_per_s")
OPTIONAL = ("name", "nodes", "memory_bandwidth_gb_per_s", "intra_node_latency_us", "inter_node_latency_us",
            "link_efficiency", "memory_efficiency", "reserved_gib", "gemm", "fused_attention_speedup", "source",
            "notes", *FACTOR_NAMES)


def is_gpu_cluster_file(data: dict) -> bool:
    return "devices_per_node" in data


def gpu_cluster_from_dict(data: dict, *, default_name: str) -> Cluster:
    """Parse the GPU cluster format; ValueError naming the missing or malformed key."""
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ValueError(f"cluster file {default_name}: missing required key(s) {', '.join(missing)} "
                         f"(required: {', '.join(REQUIRED)})")
    peaks = data["peak_tflops"]
    if not isinstance(peaks, dict) or not set(PRECISION_KEYS) <= set(peaks) <= {*PRECISION_KEYS, "fp8"}:
        raise ValueError(f"cluster file {default_name}: peak_tflops must be an object with the keys "
                         f"{', '.join(PRECISION_KEYS)} (and optionally fp8; dense TFLOP/s per device), got {peaks!r}")
    unknown = set(data) - set(REQUIRED) - set(OPTIONAL)
    if unknown:
        raise ValueError(f"cluster file {default_name}: unknown key(s) {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(sorted((*REQUIRED, *OPTIONAL)))})")
    defaults = GpuDevice(1.0, {})
    gemm = data.get("gemm", {})
    if not isinstance(gemm, dict) or set(gemm) - {"max_efficiency", "k_half"}:
        raise ValueError(f"cluster file {default_name}: gemm must be an object with max_efficiency and / or k_half, "
                         f"got {gemm!r}")
    fused = data.get("fused_attention_speedup")
    if fused is not None and not (isinstance(fused, dict) and set(fused) == {"forward", "backward"}
                                  and all(isinstance(v, (int, float)) and v > 0 for v in fused.values())):
        raise ValueError(f"cluster file {default_name}: fused_attention_speedup must be an object with positive "
                         f"forward and backward (cuDNN's fused attention over FlashAttention-2), got {fused!r}")
    device = GpuDevice(
        fused_attention_speedup=(float(fused["forward"]), float(fused["backward"])) if fused else None,
        memory_gib=float(data["memory_gib"]), peak_flops={p: float(v) * 1e12 for p, v in peaks.items()},
        memory_bandwidth=float(data.get("memory_bandwidth_gb_per_s", defaults.memory_bandwidth / 1e9)) * 1e9,
        memory_efficiency=float(data.get("memory_efficiency", defaults.memory_efficiency)),
        reserved_gib=float(data.get("reserved_gib", defaults.reserved_gib)),
        gemm=GemmEfficiency(**{k: float(v) for k, v in gemm.items()}))
    topology = Topology(
        devices_per_node=int(data["devices_per_node"]),
        intra=Link(float(data["intra_node_gb_per_s"]) * 1e9, float(data.get("intra_node_latency_us", 5)) * 1e-6),
        inter=Link(float(data["inter_node_gb_per_s"]) * 1e9, float(data.get("inter_node_latency_us", 10)) * 1e-6),
        efficiency=float(data.get("link_efficiency", 0.8)), nodes=data.get("nodes"))
    factors = EngineFactors(**{k: float(data[k]) for k in FACTOR_NAMES if k in data})
    return Cluster(data.get("name", default_name), device, topology, factors, data.get("source", ""),
                   data.get("notes", {}))


def gpu_file(c: Cluster) -> dict:
    d, t = c.device, c.topology
    out = {"name": c.name, "devices_per_node": t.devices_per_node, "memory_gib": d.memory_gib,
           "peak_tflops": {p: v / 1e12 for p, v in d.peak_flops.items()},
           "intra_node_gb_per_s": t.intra.bandwidth / 1e9, "inter_node_gb_per_s": t.inter.bandwidth / 1e9,
           "memory_bandwidth_gb_per_s": d.memory_bandwidth / 1e9, "intra_node_latency_us": t.intra.latency * 1e6,
           "inter_node_latency_us": t.inter.latency * 1e6, "link_efficiency": t.efficiency,
           "memory_efficiency": d.memory_efficiency, "reserved_gib": d.reserved_gib,
           "gemm": {"max_efficiency": d.gemm.max_efficiency, "k_half": d.gemm.k_half}, **asdict(c.factors),
           "source": c.source, "notes": c.notes}
    if d.fused_attention_speedup:
        out["fused_attention_speedup"] = dict(zip(("forward", "backward"), d.fused_attention_speedup))
    return {**out, "nodes": t.nodes} if t.nodes is not None else out


# --- loading ---------------------------------------------------------------------------------------------

def load_cluster(path_or_name: str) -> Cluster:
    """A JSON file path, or the name of a preset in compiler/clusters/ (without .json)."""
    path = Path(path_or_name)
    if not path.exists():
        path = PRESET_DIR / f"{path_or_name}.json"
    if not path.exists():
        raise ValueError(f"--cluster {path_or_name}: no such file or preset (presets: {', '.join(preset_names())})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--cluster {path_or_name}: not JSON ({e})") from None
    if is_gpu_cluster_file(data):
        return gpu_cluster_from_dict(data, default_name=path.stem)
    try:
        return cpu_cluster_from_dict(data)
    except ValueError as e:
        raise ValueError(f"cluster file {path.stem}: {e}") from None


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


def resolve_cluster(name: str | None) -> Cluster:
    """``--cluster``: a file or preset. By default, on a CUDA machine the preset of its GPU, with this engine's
    factors fitted to measured runs where a ``<preset>-engine`` file holds them; otherwise this machine's
    calibration, else the local preset."""
    if name:
        return load_cluster(name)
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
        preset = preset_for_device(device)
        if preset is None:
            raise ValueError(f"no cluster preset matches this machine's GPU ({device}); pass --cluster FILE.json "
                             f"(the format is in compiler/README.md; presets: {', '.join(preset_names())})")
        fitted = f"{preset}-engine"
        return load_cluster(fitted if (PRESET_DIR / f"{fitted}.json").exists() else preset)
    return load_cluster(str(CALIBRATED) if CALIBRATED.exists() else LOCAL_PRESET)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))
