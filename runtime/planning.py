"""Plans for a run: the planner (compiler/planner) asked about a TrainConfig's model on any cluster, every plan
it calls feasible being one the engine's own validation accepts once applied to that config."""

from __future__ import annotations

import dataclasses

from compiler.planner.candidates import Constraints
from compiler.planner.cluster import Cluster
from compiler.planner.search import Estimate, SearchResult, search
from compiler.planner.shape import DecoderShape
from compiler.precisions import PRECISIONS
from runtime.config import ConfigError, TrainConfig, plan_error

# What the engine runs: every dimension the planner prices, and always the chunked loss (runtime/config.py
# ``plan_error`` refuses the rest).
ENGINE_RUNS = Constraints(chunked_loss=True)


def engine_search(base: TrainConfig, *, world: int, global_batch_size: int, cluster: Cluster,
                  precisions: tuple[str, ...], constraints: Constraints = ENGINE_RUNS, keep: int = 1,
                  collect: bool = False) -> SearchResult:
    """The planner's search for ``base``'s model, within what the engine runs, validated by it."""
    return search(DecoderShape.from_config(base.model), world=world, global_batch_size=global_batch_size,
                  cluster=cluster, precisions=precisions, constraints=constraints,
                  validate=lambda candidate: plan_error(base, candidate), keep=keep, collect=collect)


def rank_plans(base: TrainConfig, *, world: int, global_batch_size: int, cluster: Cluster,
               precisions: tuple[str, ...] = tuple(PRECISIONS),
               activation_checkpointing: tuple[bool, ...] = (False, True), max_cp: int | None = None) -> list[Estimate]:
    """Every plan for ``base``'s model on ``world`` ranks: feasible first, fastest first (infeasible ones with
    their reason). ``max_cp``: the most context-parallel ranks tried (default: the planner's, by sequence length)."""
    modes = tuple(m for m, on in (("none", False), ("selective", True), ("full", True)) if on in activation_checkpointing)
    constraints = Constraints(chunked_loss=True, ac_modes=modes, max_cp=max_cp)
    return engine_search(base, world=world, global_batch_size=global_batch_size, cluster=cluster,
                         precisions=precisions, constraints=constraints, collect=True).every


def best_plan(base: TrainConfig, *, world: int, global_batch_size: int, cluster: Cluster,
              precisions: tuple[str, ...], held: dict | None = None) -> Estimate:
    """``--auto``: the fastest plan that fits, for a CPU machine or a GPU cluster alike; ``held``: Constraints
    fields the user fixed (e.g. ``sequence_parallel=True``, ``cp=2``)."""
    result = engine_search(base, world=world, global_batch_size=global_batch_size, cluster=cluster,
                           precisions=precisions, constraints=dataclasses.replace(ENGINE_RUNS, **(held or {})))
    if result.best is None:
        raise ConfigError(f"--auto found no feasible plan for {world} ranks on {cluster.name} ({result.reasons()})")
    return result.best
