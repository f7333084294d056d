"""The planner asked about a model the engine builds: every plan it calls feasible is one the engine's own
validation accepts (``validate``: the engine's check of a plan for that run, runtime/config.py ``plan_checker``).
``--auto`` trains with ``best_plan``; the memory preflight and ``run.py validate`` rank every plan."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from compiler.lora import LoraConfig
from compiler.parallel_plan import ParallelPlan
from compiler.planner.candidates import Constraints
from compiler.planner.cluster import Cluster
from compiler.planner.search import Estimate, SearchResult, search
from compiler.planner.shape import DecoderShape
from compiler.precisions import PRECISIONS

DEFAULT_GLOBAL_BATCH = 32  # sequences per step when a user names none (plan, --auto)

# What the engine runs: every dimension the planner prices, and always the chunked loss.
ENGINE_RUNS = Constraints(chunked_loss=True)

PlanCheck = Callable[[ParallelPlan], "str | None"]  # why the engine would refuse a plan, or None


class NoPlanError(ValueError):
    """No plan the engine runs fits the world and cluster."""


def engine_search(model: Any, *, world: int, global_batch_size: int, cluster: Cluster, precisions: tuple[str, ...],
                  validate: PlanCheck, constraints: Constraints = ENGINE_RUNS, keep: int = 1,
                  collect: bool = False, lora: LoraConfig | None = None) -> SearchResult:
    """The planner's search for ``model`` (a family's config), within what the engine runs (``lora``: a LoRA run's)."""
    return search(DecoderShape.from_config(model), world=world, global_batch_size=global_batch_size,
                  cluster=cluster, precisions=precisions, constraints=constraints, validate=validate, keep=keep,
                  collect=collect, lora=lora)


def rank_plans(model: Any, *, world: int, global_batch_size: int, cluster: Cluster, validate: PlanCheck,
               precisions: tuple[str, ...] = tuple(PRECISIONS), ac_modes: tuple[str, ...] = ("none", "selective", "full"),
               max_cp: int | None = None, lora: LoraConfig | None = None) -> list[Estimate]:
    """Every plan for ``model`` on ``world`` ranks: feasible first, fastest first (infeasible ones with their
    reason). ``max_cp``: the most context-parallel ranks tried (default: the planner's, by sequence length)."""
    constraints = dataclasses.replace(ENGINE_RUNS, ac_modes=ac_modes, max_cp=max_cp)
    return engine_search(model, world=world, global_batch_size=global_batch_size, cluster=cluster,
                         precisions=precisions, validate=validate, constraints=constraints, collect=True,
                         lora=lora).every


def best_plan(model: Any, *, world: int, global_batch_size: int, cluster: Cluster, precisions: tuple[str, ...],
              validate: PlanCheck, held: dict | None = None, lora: LoraConfig | None = None) -> Estimate:
    """``--auto``: the fastest plan that fits, for a CPU machine or a GPU cluster alike; ``held``: Constraints
    fields the user fixed (e.g. ``sequence_parallel=True``, ``cp=2``)."""
    result = engine_search(model, world=world, global_batch_size=global_batch_size, cluster=cluster,
                           precisions=precisions, validate=validate,
                           constraints=dataclasses.replace(ENGINE_RUNS, **(held or {})), lora=lora)
    if result.best is None:
        raise NoPlanError(f"--auto found no feasible plan for {world} ranks on {cluster.name} ({result.reasons()})")
    return result.best
