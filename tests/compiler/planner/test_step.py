"""The planner's step model (compiler/planner/step.py) against hand computations: data-parallel exposure by mode and
device, pipeline messages, the bubble's stretch, and the engine factors."""

from __future__ import annotations

import dataclasses

import pytest

from compiler.parallel_plan import ParallelPlan
from compiler.planner.cluster import load_cluster
from compiler.planner.collectives import all_gather_time, all_reduce_time
from compiler.planner.devices import ComputeSeconds
from compiler.planner.engines import MEGATRON_2021, THIS_ENGINE
from compiler.planner.layers import LayerSeconds
from compiler.planner.step import bubble, data_parallel_seconds, message_seconds, step_time

H100, CPU = load_cluster("h100-80gb"), load_cluster("cpu-2core")
STRIDES = THIS_ENGINE.strides({"dp": 16, "pp": 1, "cp": 1, "mp": 8})  # dp ranks 8 apart: one per node
PARAMS = 1e9


def _plan(**kw):
    return ParallelPlan(**{**dict(dp=16, pp=1, mp=8, schedule="1f1b", stages_per_rank=1, microbatches=4,
                                micro_batch_size=1, precision="bf16", chunked_loss=False), **kw})


def test_fsdp_gathers_behind_the_first_forward_and_scatters_behind_the_last_backward():
    link = H100.topology.group_link(16, 8)
    gather, scatter = all_gather_time(2 * PARAMS, 16, link), all_gather_time(4 * PARAMS, 16, link)
    per_unit = 9 * link.steps(16) / 2 * link.latency  # ten units, each its own collective
    gather, scatter = gather + per_unit, scatter + per_unit
    exposed = data_parallel_seconds(_plan(), H100, THIS_ENGINE, dense_params=PARAMS, expert_params=0, units=10,
                                    forward=0.01, backward=0.02, strides=STRIDES)
    assert exposed == pytest.approx(gather / 10 + max(0, gather - 0.01) + max(0, scatter - 0.02))
    # Nothing overlaps on a CPU (gloo and compute share its cores), nor in an engine that reduces afterwards.
    hidden_nowhere = data_parallel_seconds(_plan(), H100, MEGATRON_2021, dense_params=PARAMS, expert_params=0,
                                           units=10, forward=0.01, backward=0.02, strides=STRIDES)
    assert hidden_nowhere == pytest.approx(gather + all_gather_time(2 * PARAMS, 16, link) + per_unit)  # fp16 grads


def test_zero3_gathers_twice_and_scatters_once_per_micro_batch():
    link = H100.topology.group_link(16, 8)
    gather, scatter = all_gather_time(2 * PARAMS, 16, link), all_gather_time(4 * PARAMS, 16, link)
    exposed = data_parallel_seconds(_plan(reshard_after_forward=True), H100, THIS_ENGINE, dense_params=PARAMS,
                                    expert_params=0, units=1, forward=1e-3, backward=2e-3, strides=STRIDES)
    assert exposed == pytest.approx(4 * (max(0, 2 * gather + scatter - 3e-3) + gather))


def test_replicate_all_reduces_fp32_gradients_in_buckets():
    link = H100.topology.group_link(16, 8)
    grads = 4 * PARAMS
    buckets = -(-grads // (25 * 2**20))
    expected = all_reduce_time(grads, 16, link) + (buckets - 1) * link.steps(16) * link.latency
    exposed = data_parallel_seconds(_plan(dp_shard=1), H100, THIS_ENGINE, dense_params=PARAMS, expert_params=0,
                                    units=1, forward=0, backward=0, strides=STRIDES)
    assert exposed == pytest.approx(expected)


def test_context_parallel_ranks_shard_with_data_parallel_ones():
    """FSDP over dp x cp: the same bytes over twice the ranks, each shard half as large."""
    strides = THIS_ENGINE.strides({"dp": 8, "pp": 1, "cp": 2, "mp": 4})
    link = H100.topology.dims_link([(2, strides["cp"]), (8, strides["dp"])])
    expected = all_gather_time(2 * PARAMS, 16, link) + all_gather_time(4 * PARAMS, 16, link)
    exposed = data_parallel_seconds(_plan(dp=8, mp=4, cp=2), H100, MEGATRON_2021.__class__(grad_reduce_bytes=4,
                                    dp_overlap=False), dense_params=PARAMS, expert_params=0, units=1, forward=0,
                                    backward=0, strides=strides)
    assert exposed == pytest.approx(expected)


def test_pipeline_messages_are_sequence_shards_under_sp():
    c = _plan(dp=1, pp=4, mp=2, microbatches=8, micro_batch_size=2)
    strides = THIS_ENGINE.strides({"dp": 1, "pp": 4, "cp": 1, "mp": 2})
    whole = message_seconds(c, H100, THIS_ENGINE, seq_len=4096, d_model=8192, strides=strides)
    link = H100.topology.neighbour_link(4, 2)
    assert whole == pytest.approx(link.latency + 2 * 4096 * 8192 * 2 / link.bandwidth)
    shards = message_seconds(dataclasses.replace(c, sequence_parallel=True), H100, THIS_ENGINE, seq_len=4096,
                             d_model=8192, strides=strides)
    assert shards == pytest.approx(link.latency + 2 * 4096 * 8192 * 2 / 2 / link.bandwidth)


def test_the_bubble_stretches_everything_a_stage_does_and_the_factors_scale_their_terms():
    c = _plan(dp=1, pp=4, mp=1, microbatches=8)
    busiest = LayerSeconds(ComputeSeconds(0.1, 0.2, 0.0), tp=0.01)
    cluster = H100.with_factors(compute_scale=1.5, comm_scale=2.0, action_overhead=0.001, step_overhead=0.05)
    strides = THIS_ENGINE.strides({"dp": 1, "pp": 4, "cp": 1, "mp": 1})
    step = step_time(c, cluster, THIS_ENGINE, busiest=busiest, rank_params=1e9, rank_dense_params=1e9, units=5,
                     seq_len=4096, d_model=4096, strides=strides)
    stretch = 1 / (1 - bubble(c))
    assert bubble(c) == pytest.approx(3 / 11)  # 1F1B: (p - 1) / (m + p - 1)
    message = message_seconds(c, cluster, THIS_ENGINE, seq_len=4096, d_model=4096, strides=strides)
    work = 1.5 * 8 * 0.3 + 2.0 * (8 * 0.01 + 8 * 2 * message) + 0.001 * 8 * 2
    optimizer = cluster.device.optimizer_seconds(1e9)
    assert step.seconds == pytest.approx(work * stretch + 0.05 + optimizer)
    assert step.terms.combine(cluster.factors) == pytest.approx(step.seconds)


def test_cpu_ranks_beyond_the_cores_time_share_them():
    """8 ranks on 2 cores, half of them busy at once (a 50% bubble): compute slows 2x."""
    assert CPU.device.sharing(ranks_on_node=8, busy=0.5) == 2.0
    assert CPU.device.sharing(ranks_on_node=2, busy=1.0) == 1.0
    assert CPU.device.rate("fp32", ranks_on_node=1) == 2 * CPU.device.flops["fp32"]  # one rank: both cores
