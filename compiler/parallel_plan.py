"""How a run is laid out on its ranks: one frozen object read by the planner, ``--auto``, the training
config and the study alike.

A plan is the mesh (dp x pp x cp x mp ranks; ep borrows its ranks from dp), the pipeline schedule, its
stages per rank and the stage split, the micro-batching, the precision and FP8 recipe, activation checkpointing, how data
parallelism holds the state (FSDP, ZeRO-3, replicate, HSDP) and in which dtype it reduces gradients,
sequence parallelism, and what context parallelism gathers for latent attention. Flags map onto its fields in one
table (runtime/commands/flag_table.py); the planner's search builds plans (compiler/planner/), the engine validates
and runs them (runtime/config.py).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Mapping

DEFAULT_SCHEDULE = "interleaved-1f1b"


class AC(str, enum.Enum):
    """Activation checkpointing (compiler/parallelize/activation_checkpointing.py): ``full`` keeps each block's
    input and recomputes the block in backward; ``selective`` keeps matrix products' and attention's outputs and
    recomputes the rest. A ``str`` enum: ``AC.FULL == "full"``, and it serialises as its name."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    def __str__(self) -> str:
        return self.value


AC_MODES = tuple(m.value for m in AC)


@dataclass(frozen=True)
class ParallelPlan:
    dp: int = 1
    pp: int = 1
    mp: int = 1
    cp: int = 1  # context parallelism: each sequence's tokens split over cp ranks
    ep: int = 1  # expert parallelism: experts split over ep ranks borrowed from dp
    schedule: str = DEFAULT_SCHEDULE
    stages_per_rank: int = 1  # v, virtual stages per pp rank
    microbatches: int = 1  # m, per dp replica and step
    micro_batch_size: int = 1  # sequences per micro-batch
    precision: str = "fp32"
    ac: AC = AC.NONE
    dp_shard: int | None = None  # ranks a parameter is sharded over (None: dp, FSDP; 1: replicate; else HSDP)
    reshard_after_forward: bool = False  # ZeRO-3: gather parameters again for every micro-batch's backward
    reduce_dtype: str = "fp32"  # gradient communication's precision
    sequence_parallel: bool = False  # norms and residual stream on sequence shards (mp > 1)
    split: str = "auto"  # stage split: "auto" | "uniform" | "manual:4,4,3,1"
    chunked_loss: bool = True  # the loss a chunk of tokens at a time (the engine's always is; plans at scale may not)
    fp8: str | None = None  # FP8 recipe of the linear and expert products (compiler/fp8 RECIPES); None: --precision's
    fp8_all_gather: bool = False  # FSDP all-gathers the FP8 linears' weights in FP8 (tensorwise, sharded data parallelism)
    cp_gather: str = "auto"  # what CP gathers for latent attention: auto | latent | kv (compiler/context_gather.py)

    def __post_init__(self):
        object.__setattr__(self, "ac", AC(self.ac))  # accept the mode's name

    @property
    def shard(self) -> int:
        """Ranks a parameter is sharded over."""
        return self.dp_shard or self.dp

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.mp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.microbatches * self.dp

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def replicated(self) -> bool:
        """DDP's layout: every data-parallel rank holds the whole stage, gradients all-reduced."""
        return self.dp > 1 and self.shard == 1

    @property
    def dp_mode(self) -> str:
        """The DP mode's name: none, fsdp, zero3, replicate or hsdp:N (cp ranks shard like dp ranks: at dp 1 and
        cp > 1, fsdp or zero3)."""
        if self.dp == 1:
            return ("zero3" if self.reshard_after_forward else "fsdp") if self.cp > 1 else "none"
        if self.shard == self.dp:
            return "zero3" if self.reshard_after_forward else "fsdp"
        return "replicate" if self.shard == 1 else f"hsdp:{self.shard}"

    def mesh_text(self) -> str:
        extra = (f" cp={self.cp}" if self.cp > 1 else "") + (f" ep={self.ep}" if self.ep > 1 else "")
        return f"{self.dp}x{self.pp}x{self.mp}{extra}"

    def describe(self) -> str:
        ac = {AC.FULL: " +AC", AC.SELECTIVE: " +SAC", AC.NONE: ""}[self.ac]
        dp_mode = ""
        if self.dp > 1 and self.shard != self.dp:
            dp_mode = " replicate" if self.shard == 1 else f" hsdp={self.shard}"
        dp_mode += " zero3" if self.reshard_after_forward else ""
        dp_mode += " +SP" if self.sequence_parallel else ""
        dp_mode += " +chunked loss" if self.chunked_loss else ""
        dp_mode += f" fp8={self.fp8}" if self.fp8 else ""
        dp_mode += " +fp8 all-gather" if self.fp8_all_gather else ""
        dp_mode += f" cp-gather={self.cp_gather}" if self.cp_gather != "auto" else ""
        return (f"{self.mesh_text()} {self.schedule} v={self.stages_per_rank} m={self.microbatches} "
                f"mbs={self.micro_batch_size} {self.precision}{ac}{dp_mode}")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["ac"] = self.ac.value
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "ParallelPlan":
        known = {f.name for f in dataclasses.fields(ParallelPlan)}
        return ParallelPlan(**{k: v for k, v in d.items() if k in known})


def fp8_all_gather_problem(plan: ParallelPlan) -> str | None:
    """Why the engine cannot run ``plan`` with ``fp8_all_gather`` (None: it can, or the plan does not ask). FSDP can
    gather a weight in FP8 only when one scale spans the whole weight (a shard quantized with it holds the whole's
    bytes): tensorwise; rowwise and blockwise scale rows or blocks of the gathered weight. And only sharded data
    parallelism gathers. One rule for train's check (runtime/config.py) and the planner's search."""
    if not plan.fp8_all_gather:
        return None
    if plan.fp8 != "tensorwise":
        got = f"--fp8 {plan.fp8}" if plan.fp8 else "no --fp8"
        return (f"--fp8-all-gather needs --fp8 tensorwise (one scale per weight, which FSDP can apply to its shards), "
                f"got {got}")
    if plan.dp * plan.cp == 1 or plan.replicated:
        return (f"--fp8-all-gather needs sharded data parallelism (FSDP, HSDP or ZeRO-3: --dp or --cp above 1, "
                f"--dp-shard above 1), got --dp {plan.dp} --cp {plan.cp} --dp-shard {plan.dp_shard}")
    return None


def dp_mode_name(dp: int, cp: int, dp_shard: int | None, reshard_after_forward: bool) -> str:
    """``ParallelPlan.dp_mode`` of a plan with these fields."""
    return ParallelPlan(dp=dp, cp=cp, dp_shard=dp_shard, reshard_after_forward=reshard_after_forward).dp_mode


def is_dp_mode(name: str) -> bool:
    """Whether ``name`` is a DP mode ``dp_mode`` can return: none, fsdp, zero3, replicate or hsdp:N."""
    return name in ("none", "fsdp", "zero3", "replicate") or (name.startswith("hsdp:") and name[5:].isdigit())


def dp_shard_of_mode(name: str) -> int | None:
    """The ``dp_shard`` a plan of DP mode ``name`` holds (``is_dp_mode``): 1 for replicate, N for hsdp:N, None (shard
    over every dp rank) for the others."""
    return 1 if name == "replicate" else int(name[5:]) if name.startswith("hsdp:") else None


def plan_of_run(config: Mapping[str, Any]) -> ParallelPlan:
    """The plan a recorded run's config (``TrainConfig.to_dict()``, in summary.json and checkpoints) trained with:
    its ``plan``, or the separate mesh / pipeline / data-parallel fields that runs recorded before plans existed
    kept (``activation_checkpointing`` a bool before selective checkpointing)."""
    if "plan" in config:
        return ParallelPlan.from_dict(config["plan"])
    mesh, pipe, dp = config["mesh"], config["pipeline"], config["data_parallel"]
    ac = config.get("activation_checkpointing", "none")
    ac = ("full" if ac else "none") if isinstance(ac, bool) else ac
    shard = dp["shard"]
    return ParallelPlan(
        dp=mesh["dp"], pp=mesh["pp"], mp=mesh["mp"], cp=mesh.get("cp", 1), ep=mesh.get("ep", 1),
        schedule=pipe["schedule"], stages_per_rank=pipe["stages_per_rank"], microbatches=pipe["microbatches"],
        micro_batch_size=pipe["micro_batch_size"], precision=config["precision"], ac=ac,
        dp_shard=None if shard == mesh["dp"] else shard, reshard_after_forward=dp["reshard_after_forward"],
        reduce_dtype=dp.get("reduce_dtype", "fp32"),
        sequence_parallel=config.get("sequence_parallel", False) and mesh["mp"] > 1, split=pipe.get("split", "auto"),
        chunked_loss=config.get("chunked_loss", False))
