"""Memory preflight: before any process group, price the run's own configuration with the planner's
memory model and refuse one that would overflow the node, naming the flags (or the plan) that fit.

CPU: the node's ranks share its RAM. Each rank's resident memory is its tensors (the memory model,
compiler/planner/memory_model.py, per pp rank) plus what is not a tensor: the interpreter, torch and
its libraries, gloo's buffers, the allocator. That part is calibrated from the README's GPT-2 Large
runs at 2x2x2 (sequence 256, bf16, micro-batch 1, 4 micro-batches) on this 23.5 GiB machine:
- ZeRO-3 + AC + --compact-cpu-memory: 19.1 GiB used (2.4-2.6 GiB resident per rank) where the memory
  model gives 15.9 GiB of tensors for the 8 ranks: (19.1 - 15.9) / 8 = 0.40 GiB per rank;
- ZeRO-3 alone: 21.0 GiB used; the model, 18.4 + 8 x 0.40 = 21.6 GiB (3% high);
- the default (FSDP, no AC): OOM-killed at 23.5 GiB in step 1; the model, 24.9 + 3.2 = 28.1 GiB.
``--compact-cpu-memory`` makes resident memory follow live tensors (runtime/device.py), which is what
the model prices; without it freed holes may stay resident (18.8 vs 13.0 GB measured on GPT-2 Large
layers), which these runs did not show, so it is not charged, but it is suggested with any fix.
The budget is 90% of MemTotal (page cache, other processes and the model's few percent); a prediction
above what is free now (MemAvailable) but within the budget is a warning, not an error.

GPU: each rank has its device; its fullest pp rank's tensors plus the cluster model's reserve (CUDA
context, NCCL buffers, fragmentation: compiler/planner/devices.py) must fit the device's memory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from compiler.planner.cluster import LOCAL_PRESET, load_cluster
from compiler.planner.devices import GpuDevice
from compiler.planner.pricer import Pricer
from compiler.planner.shape import DecoderShape
from runtime.commands.flag_table import plan_flags
from runtime.config import ConfigError, TrainConfig, plan_checker, plan_error
from runtime.device import device_index
from runtime.distributed.mesh import grid_layout

GIB = 2**30
CPU_RANK_OVERHEAD = 0.40 * GIB  # resident bytes per rank beyond its tensors (module docstring)
RAM_BUDGET = 0.90  # of MemTotal
GPU_RESERVED = GpuDevice(1.0, {}).reserved_gib * GIB
GPU_MEMORY_MODEL = "h100-80gb"  # any GPU preset: the memory model does not depend on which GPU


@dataclasses.dataclass(frozen=True)
class NodeMemory:
    total: float  # bytes of RAM (CPU) or of one device (GPU)
    available: float | None = None  # RAM free now (MemAvailable); None on GPU
    per_device: bool = False  # GPU: every rank has ``total`` of its own


def node_ram(meminfo: str | Path = "/proc/meminfo") -> NodeMemory | None:
    """MemTotal and MemAvailable, or None where /proc/meminfo does not exist."""
    path = Path(meminfo)
    if not path.exists():
        return None
    values = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            values[key] = int(rest.split()[0]) * 1024
    return NodeMemory(values["MemTotal"], values.get("MemAvailable")) if "MemTotal" in values else None


def _pricer(cfg: TrainConfig) -> Pricer:
    """The planner's model of ``cfg``'s model on its device kind, from the closed-form shapes (no tracing:
    seconds on every rank before the run starts)."""
    cluster = load_cluster(LOCAL_PRESET if cfg.device == "cpu" else GPU_MEMORY_MODEL)
    return Pricer(DecoderShape.from_config(cfg.model), cluster, lora=cfg.lora)


def node_memory(local_rank: int, device_type: str) -> NodeMemory | None:
    """On CUDA the memory of the device this rank takes (runtime/device.py ``device_index``), else the
    node's RAM (``--device cpu`` on a GPU machine included)."""
    if device_type == "cuda" and torch.cuda.is_available():
        index = device_index(local_rank, visible=torch.cuda.device_count())
        return NodeMemory(float(torch.cuda.get_device_properties(index).total_memory), per_device=True)
    return node_ram()


def node_ranks(*, rank: int, local_world_size: int) -> list[int]:
    """The global ranks on this rank's node (torchrun numbers a node's ranks consecutively)."""
    first = rank // local_world_size * local_world_size
    return list(range(first, first + local_world_size))


def predicted_tensor_bytes(cfg: TrainConfig) -> float:
    """The memory model's peak tensor bytes of the fullest rank: what ``max_memory_allocated`` measures on a
    GPU (summary.json's ``peak_bytes``) and ``--profile-memory`` on the CPU (``peak_tensor_bytes``)."""
    return max(_pricer(cfg).rank_memories(cfg.plan))


def predicted_bytes(cfg: TrainConfig, *, node_ranks: list[int], memory: NodeMemory) -> float:
    """CPU: the node's ranks' tensors and runtime together; GPU: the fullest rank's tensors and reserve."""
    c = cfg.plan
    peaks = _pricer(cfg).rank_memories(c)
    if memory.per_device:
        return max(peaks) + GPU_RESERVED
    return sum(peaks[(rank // (c.mp * c.cp)) % c.pp] + CPU_RANK_OVERHEAD for rank in node_ranks)  # rank -> pp index


def _budget(memory: NodeMemory) -> float:
    return memory.total if memory.per_device else RAM_BUDGET * memory.total


def _fix(cfg: TrainConfig, *, node_ranks: list[int], memory: NodeMemory) -> tuple[str, float] | None:
    """The cheapest memory flags that make ``cfg`` fit: (flags, predicted bytes), or None."""
    options = [("--activation-checkpointing",)]
    if grid_layout(cfg.plan).sharded:
        options += [("--reshard-after-forward",), ("--reshard-after-forward", "--activation-checkpointing")]
    for flags in options:
        trial = dataclasses.replace(cfg, plan=dataclasses.replace(
            cfg.plan, ac="full" if "--activation-checkpointing" in flags else cfg.plan.ac,
            reshard_after_forward=cfg.plan.reshard_after_forward or "--reshard-after-forward" in flags))
        if trial == cfg:
            continue
        bytes_ = predicted_bytes(trial, node_ranks=node_ranks, memory=memory)
        if bytes_ <= _budget(memory):
            extra = () if memory.per_device or cfg.placement.compact_cpu_memory else ("--compact-cpu-memory",)
            return " ".join(flags + extra), bytes_
    return None


def _fitting_plan(cfg: TrainConfig, *, world: int, node_ranks: list[int], memory: NodeMemory) -> str | None:
    """Flags of the planner's best plan for this world within the budget (CPU), or None."""
    if memory.per_device:
        return None
    base = load_cluster(LOCAL_PRESET)
    device = dataclasses.replace(base.device, memory_per_node=max(0.0, _budget(memory) - len(node_ranks) * CPU_RANK_OVERHEAD))
    cluster = dataclasses.replace(base, device=device,
                                  topology=dataclasses.replace(base.topology, devices_per_node=len(node_ranks)))
    # The search runs only on this refusal path: a run that fits never loads it (the training command imports
    # the planner's search only for --auto).
    from compiler.planner.auto import rank_plans

    plans = rank_plans(cfg.model, world=world, global_batch_size=cfg.global_batch_size, cluster=cluster,
                       validate=plan_checker(cfg), precisions=(cfg.plan.precision,), lora=cfg.lora)
    best = next((e for e in plans if e.feasible), None)
    return " ".join(plan_flags(best.plan)) if best else None


def check_memory(cfg: TrainConfig, *, world: int, node_ranks: list[int], memory: NodeMemory | None) -> str | None:
    """Raise ConfigError when ``cfg`` is predicted to overflow the node's memory, naming what fits; return
    a warning line when it fits the budget but not what is free now; None otherwise."""
    if memory is None or plan_error(cfg, cfg.plan):
        return None  # unknown memory, or a configuration the validation rejects anyway
    need = predicted_bytes(cfg, node_ranks=node_ranks, memory=memory)
    budget = _budget(memory)
    where = (f"per GPU (tensors + {GPU_RESERVED / GIB:.0f} GiB of CUDA context and buffers) of {memory.total / GIB:.1f} GiB"
             if memory.per_device else
             f"for the {len(node_ranks)} ranks on this node (tensors + {CPU_RANK_OVERHEAD / GIB:.2f} GiB of runtime "
             f"per rank) of {budget / GIB:.1f} GiB (90% of {memory.total / GIB:.1f} GiB RAM)")
    if need > budget:
        fix = _fix(cfg, node_ranks=node_ranks, memory=memory)
        if fix:
            advice = f"add {fix[0]} (predicted {fix[1] / GIB:.1f} GiB)"
        else:
            plan = _fitting_plan(cfg, world=world, node_ranks=node_ranks, memory=memory)
            advice = f"a plan that fits: {plan}" if plan else "no plan of this model fits; use more nodes or a smaller model"
        raise ConfigError(f"predicted memory {need / GIB:.1f} GiB {where} would not fit; {advice} "
                          f"(or --skip-memory-check)")
    if memory.available is not None and need > memory.available:
        return (f"warning: predicted memory {need / GIB:.1f} GiB {where}, but only {memory.available / GIB:.1f} GiB "
                f"is free now")
    return None
