"""The planner's memory model against measured peak tensor memory of real runs (--profile-memory).

Tolerance: within 20% of the measurement (the largest error seen here was 17%, activation
checkpointing). The model counts weights, gradients, AdamW state, saved activations times in-flight
micro-batches, the logits the last stage holds and the loss's backward temporaries, and autocast weight
copies; it leaves out other transient buffers (p2p receive buffers, attention workspaces), so it may err
either way by that much; it errs low so far. On an H200 the same model was within 2% of
``max_memory_allocated`` for GPT-2 small and a 1B Llama (README, GPUs). Its tensor-parallel term (DTensor's
buffers) was itself measured on the 1x1x2 case below (before it that case measured 18-25% above the model), so that
case checks consistency, not prediction.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from compiler.parallel_plan import ParallelPlan
from compiler.planner.cluster import load_cluster
from compiler.planner.search import Pricer
from compiler.planner.shape import DecoderShape
from runtime.commands.flag_table import plan_flags
from runtime.commands.flags import parse_train_config
from tests.launch import QUICK_RUN, spawn_ranks, train_each

pytestmark = pytest.mark.slow  # real multi-process jobs

MODEL = ["--layers", "4", "--d-model", "128", "--heads", "4", "--seq-len", "64", "--vocab-size", "256"]
TOLERANCE = 0.20

CASES = [
    ParallelPlan(dp=1, pp=1, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=2, micro_batch_size=16,
                 precision="fp32", chunked_loss=False),
    ParallelPlan(dp=1, pp=2, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=4, micro_batch_size=8,
                 precision="fp32", chunked_loss=False),
    ParallelPlan(dp=2, pp=1, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=2, micro_batch_size=8,
                 precision="fp32", chunked_loss=False),
    ParallelPlan(dp=1, pp=2, mp=1, schedule="gpipe", stages_per_rank=1, microbatches=4, micro_batch_size=8,
                 precision="bf16", chunked_loss=False),
    ParallelPlan(dp=1, pp=1, mp=2, schedule="1f1b", stages_per_rank=1, microbatches=2, micro_batch_size=16,
                 precision="bf16", chunked_loss=False),
    ParallelPlan(dp=1, pp=2, mp=1, schedule="interleaved-1f1b", stages_per_rank=2, microbatches=4, micro_batch_size=8,
                 precision="fp32", ac="full", chunked_loss=False),
    ParallelPlan(dp=1, pp=2, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=4, micro_batch_size=8,
                 precision="bf16", ac="selective"),
    ParallelPlan(dp=2, pp=1, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=2, micro_batch_size=8,
                 precision="fp32", dp_shard=1, chunked_loss=False),  # replicate
    ParallelPlan(dp=4, pp=1, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=2, micro_batch_size=4,
                 precision="bf16", dp_shard=2, chunked_loss=False),  # HSDP, parameters gathered in bf16
    ParallelPlan(dp=2, pp=2, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=4, micro_batch_size=4,
                 precision="fp32", reshard_after_forward=True, chunked_loss=False),  # ZeRO-3, tied ends apart
    ParallelPlan(dp=2, pp=1, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=2, micro_batch_size=8,
                 precision="bf16", fp8="tensorwise", fp8_all_gather=True),  # the FP8 linears' weights gathered in e4m3
]


def _flags(plan: ParallelPlan) -> list[str]:
    return [*MODEL, *plan_flags(plan)]


def _case_id(plan: ParallelPlan) -> str:
    return plan.describe().replace(" ", "_")


# The engine computes every loss in chunks (compiler/parallelize/cross_entropy.py): each plan says so.
CASES = [dataclasses.replace(c, chunked_loss=True) for c in CASES]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, tuple[Path, str | None]]:
    """Case id -> (its logdir, the error of its job or None): one spawned job per world size trains its
    cases in turn (the peak is measured per step, from that run's own tensors and allocations)."""
    root = tmp_path_factory.mktemp("memory_model")
    by_world: dict[int, list[ParallelPlan]] = {}
    for plan in CASES:
        by_world.setdefault(plan.dp * plan.pp * plan.mp, []).append(plan)
    out = {}
    for world, plans in by_world.items():
        argvs = [[*_flags(p), "--data", "synthetic", "--steps", "2", *QUICK_RUN, "--profile-memory", "--logdir",
                  str(root / _case_id(p))] for p in plans]
        try:
            spawn_ranks(train_each, world_size=world, args=(argvs,), timeout=60 + 90 * len(plans))
            error = None
        except AssertionError as e:
            error = f"the {world}-rank job failed:\n{str(e)[-4000:]}"
        out.update({_case_id(p): (root / _case_id(p), error) for p in plans})
    return out


@pytest.mark.parametrize("plan", CASES, ids=[_case_id(c) for c in CASES])
def test_memory_model_matches_measured_peak(measured, plan):
    world = plan.dp * plan.pp * plan.mp
    flags = _flags(plan)
    logdir, error = measured[_case_id(plan)]
    assert error is None, error
    summary = json.loads((logdir / "summary.json").read_text())
    peak = summary["peak_tensor_bytes"]

    cfg = parse_train_config(flags, world_size=world).model
    predicted = max(Pricer(DecoderShape.from_config(cfg), load_cluster("cpu-2core")).rank_memories(plan))
    print(f"{plan.describe()}: predicted {predicted / 2**20:.1f} MiB, measured {peak / 2**20:.1f} MiB")
    assert predicted == pytest.approx(peak,
                                      rel=TOLERANCE), f"predicted {predicted / 2**20:.1f} MiB, measured {peak / 2**20:.1f} MiB"
    # The run reports the same prediction (from the closed-form shapes, compiler/planner/shape.py).
    assert summary["predicted_peak_tensor_bytes"] == pytest.approx(predicted, rel=0.02)
