"""Plans for a run: the planner (compiler/planner) asked about a TrainConfig's model, every plan it calls
feasible being one the engine's own validation accepts once applied to that config."""

from __future__ import annotations

from compiler.planner.cluster import Cluster
from compiler.planner.search import Estimate, plan
from compiler.precisions import PRECISIONS
from runtime.config import ConfigError, TrainConfig, plan_error


def rank_plans(base: TrainConfig, *, world: int, global_batch_size: int, cluster: Cluster,
               precisions: tuple[str, ...] = tuple(PRECISIONS),
               activation_checkpointing: tuple[bool, ...] = (False, True)) -> list[Estimate]:
    """Every plan for ``base``'s model on ``world`` ranks: feasible first, fastest first."""
    return plan(base.model, world=world, global_batch_size=global_batch_size, cluster=cluster,
                validate=lambda candidate: plan_error(base, candidate), precisions=precisions,
                activation_checkpointing=activation_checkpointing)


def best_plan(base: TrainConfig, *, world: int, global_batch_size: int, cluster: Cluster,
              precisions: tuple[str, ...]) -> Estimate:
    estimates = rank_plans(base, world=world, global_batch_size=global_batch_size, cluster=cluster,
                           precisions=precisions)
    if not estimates or not estimates[0].feasible:
        raise ConfigError(f"--auto found no feasible plan for {world} ranks "
                          f"({estimates[0].reason if estimates else 'no candidates'})")
    return estimates[0]
