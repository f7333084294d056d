"""The stage partitioner is exact: its optimum equals brute force on small inputs."""

from __future__ import annotations

import itertools
import random

import pytest

from compiler.cost import block_costs_with_ends, layer_costs
from compiler.partition import balanced_split, parse_split, split_points, stage_costs, uniform_split
from compiler.stage_plan import plan_stages
from models.gpt import MODEL_SIZES, GPTConfig


def _brute_force(costs, n_stages):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balanced_split_is_optimal(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    costs = [rng.choice([rng.uniform(0.1, 10), rng.randint(1, 5)]) for _ in range(n)]
    n_stages = rng.randint(1, n)
    sizes = balanced_split(costs, n_stages)
    assert len(sizes) == n_stages and min(sizes) >= 1 and sum(sizes) == n
    assert max(stage_costs(costs, sizes)) == pytest.approx(_brute_force(costs, n_stages))


def test_heavy_head_gets_a_stage_with_fewer_blocks():
    cfg = GPTConfig(n_layers=8, d_model=256, n_heads=4, seq_len=128, vocab_size=32000, mlp_width=1024)
    plan = plan_stages(cfg, n_stages=4, micro_batch_size=4, split="auto")
    uniform = plan_stages(cfg, n_stages=4, micro_batch_size=4, split="uniform")
    assert plan.blocks_per_stage[-1] < 2 and plan.imbalance < uniform.imbalance


def test_costs_count_embedding_and_head():
    costs = layer_costs(MODEL_SIZES["tiny"], micro_batch_size=2)
    assert [c.name for c in costs] == ["embedding", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    folded = block_costs_with_ends(costs)
    assert folded[0] == costs[0].flops + costs[1].flops and folded[-1] == costs[-2].flops + costs[-1].flops


def test_parse_split():
    assert parse_split("auto", n_stages=2, n_layers=4) is None
    assert parse_split("uniform", n_stages=3, n_layers=8) == [3, 3, 2] == uniform_split(8, 3)
    assert parse_split("manual:1,3", n_stages=2, n_layers=4) == [1, 3]
    assert split_points([1, 3, 2]) == [1, 4]
    for bad in ("manual:2,3", "manual:4", "manual:0,4", "manual:a,b", "greedy"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad, n_stages=2, n_layers=4)


def _brute_force_bounded(costs, memory, limit, n_stages):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        bounds = [0, *cuts, n]
        pairs = list(zip(bounds, bounds[1:]))
        if all(sum(memory[a:b]) <= limit for a, b in pairs):
            best = min(best, max(sum(costs[a:b]) for a, b in pairs))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_memory_bounded_split_is_optimal_or_reports_infeasible(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 8)
    costs = [rng.uniform(0.1, 10) for _ in range(n)]
    memory = [rng.uniform(1, 5) for _ in range(n)]
    n_stages = rng.randint(1, n)
    limit = rng.uniform(3, 15)
    want = _brute_force_bounded(costs, memory, limit, n_stages)
    if want == float("inf"):
        with pytest.raises(ValueError, match="within"):
            balanced_split(costs, n_stages, memory=memory, memory_limit=limit)
        return
    sizes = balanced_split(costs, n_stages, memory=memory, memory_limit=limit)
    assert max(stage_costs(costs, sizes)) == pytest.approx(want)
    assert max(stage_costs(memory, sizes)) <= limit
