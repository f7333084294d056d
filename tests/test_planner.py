"""The planner: every plan it calls feasible is one the engine accepts and that fits; the ranking is by time."""

from __future__ import annotations

import dataclasses
import json

import pytest

from compiler.cost import layer_costs
from compiler.planner.candidates import Candidate, candidates, meshes
from compiler.planner.cluster import PRESET_DIR, Link, load_cluster, preset_names
from compiler.planner.gpu_cluster import GpuCluster
from compiler.planner.gpu_search import search
from compiler.planner.memory_model import DataParallelLayout, in_flight_stage_microbatches, weight_memory
from compiler.planner.search import CostTable, estimate
from compiler.planner.shape import DecoderShape
from compiler.planner.time_model import all_gather_time, all_reduce_time
from models import MODEL_NAMES, named_config
from runtime.commands import plan as plan_command
from runtime.commands.flags import default_config
from runtime.config import plan_error
from runtime.planning import rank_plans

TINY = default_config(named_config("tiny"))


@pytest.fixture(scope="module")
def cpu():
    return load_cluster("cpu-2core")


@pytest.fixture(scope="module")
def tiny_plans(cpu):
    return rank_plans(TINY, world=4, global_batch_size=16, cluster=cpu, precisions=("fp32", "bf16"))


def test_meshes_multiply_to_the_world():
    assert sorted(meshes(4)) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]


def test_every_feasible_plan_is_accepted_by_the_engine_and_fits(tiny_plans, cpu):
    feasible = [e for e in tiny_plans if e.feasible]
    assert feasible
    for e in feasible:
        c = e.candidate
        assert c.dp * c.pp * c.mp == 4
        assert plan_error(TINY, c) is None
        assert e.memory_per_rank <= cpu.memory_per_rank(4)
        assert e.step_time > 0 and e.tokens_per_sec > 0 and 0 < e.mfu


def test_infeasible_plans_say_why(tiny_plans):
    infeasible = [e for e in tiny_plans if not e.feasible]
    assert infeasible and all(e.reason for e in infeasible)
    # tiny has 4 heads and 4 layers: mp=4 is fine, but v=4 at pp=2 or pp=4 needs more layers.
    assert any("too few" in e.reason for e in infeasible if e.candidate.stages_per_rank * e.candidate.pp > 4)


def test_ranking_is_fastest_first_and_feasible_first(tiny_plans):
    times = [e.step_time for e in tiny_plans if e.feasible]
    assert times == sorted(times)
    flags = [e.feasible for e in tiny_plans]
    assert flags == sorted(flags, reverse=True)


def test_a_small_memory_budget_makes_plans_infeasible(cpu):
    small = dataclasses.replace(cpu, memory_per_node=2**20)  # 1 MiB for the whole node
    plans = rank_plans(TINY, world=2, global_batch_size=16, cluster=small, precisions=("fp32",))
    assert plans and not any(e.feasible for e in plans)
    assert any(e.reason.startswith("out of memory") for e in plans)


def test_ring_formulas():
    link = Link(bandwidth=1e9, latency=1e-5)
    assert all_reduce_time(1e9, 1, link) == 0
    assert all_reduce_time(1e9, 4, link) == pytest.approx(2 * 3 / 4 * 1.0 + 6 * 1e-5)
    assert all_gather_time(1e9, 4, link) == pytest.approx(all_reduce_time(1e9, 4, link) / 2)


def test_in_flight_micro_batches_per_schedule():
    assert in_flight_stage_microbatches("gpipe", p=4, m=8, v=1) == 8
    assert in_flight_stage_microbatches("1f1b", p=4, m=8, v=1) == 4
    assert in_flight_stage_microbatches("1f1b", p=4, m=8, v=1, rank=3) == 1
    # torch's interleaved warm-up for rank 0: (v-1) * m_round + 2 (p-1) forwards, plus the one in flight.
    assert in_flight_stage_microbatches("interleaved-1f1b", p=4, m=8, v=2) == 4 + 6 + 1


def test_presets_load():
    names = preset_names()
    assert {"cpu-2core", "a100-80gb", "h100-80gb", "h100-80gb-4x8-ib", "h200-141gb"} <= set(names)
    for name in names:
        cluster = load_cluster(name)
        flops = cluster.peak_flops if isinstance(cluster, GpuCluster) else cluster.flops
        assert set(flops) == {"fp32", "bf16", "fp16"} and cluster.source


def test_gpu_presets_prefer_tensor_cores_and_fit_a_large_model():
    h100 = load_cluster("h100-80gb")
    result = search(DecoderShape.from_config(named_config("large")), world=8, global_batch_size=32, cluster=h100,
                    precisions=("fp32", "bf16"))
    assert result.best.fits and result.best.candidate.precision == "bf16"


def test_rescaled_cluster_scales_every_predicted_step_time(cpu):
    """The speed probe's correction: a machine measured twice as slow predicts every plan twice as slow."""
    slow = cpu.rescaled(2.0, "test")
    fast = rank_plans(TINY, world=4, global_batch_size=16, cluster=cpu, precisions=("fp32",))
    slower = {e.candidate: e.step_time for e in rank_plans(TINY, world=4, global_batch_size=16, cluster=slow,
                                                             precisions=("fp32",)) if e.feasible}
    feasible = [e for e in fast if e.feasible]
    assert feasible and len(slower) == len(feasible)
    for e in feasible:
        assert slower[e.candidate] == pytest.approx(2 * e.step_time, rel=1e-9)


def test_weight_memory_by_data_parallel_mode():
    params, block = 1_000_000, 100_000
    replicate = weight_memory(params, block, DataParallelLayout(dp=4, shard=1))
    fsdp = weight_memory(params, block, DataParallelLayout(dp=4, shard=4))
    hsdp = weight_memory(params, block, DataParallelLayout(dp=4, shard=2))
    zero3 = weight_memory(params, block, DataParallelLayout(dp=4, shard=4, zero3=True))
    gathered_bf16 = weight_memory(params, block, DataParallelLayout(dp=4, shard=4, gather_bytes=2))
    assert weight_memory(params, block, DataParallelLayout()) == 16 * params
    assert replicate == 20 * params  # + the buckets' flat gradient copies
    assert fsdp == params * (16 / 4 + 4 + 4)  # shards + gathered parameters + unsharded gradients
    assert zero3 < fsdp < hsdp < replicate and gathered_bf16 == fsdp - 2 * params


def test_dp_modes_are_planned_and_accepted():
    modes = {(c.dp_shard, c.reshard_after_forward) for c in candidates(4, global_batch_size=16, precisions=("fp32",))
             if c.dp == 4}
    assert modes == {(None, False), (None, True), (1, False), (2, False)}


def test_vocabulary_parallel_costs_shard_the_embedding_and_head():
    cfg = named_config("small")
    whole, half = (layer_costs(cfg, micro_batch_size=1, mp=mp) for mp in (1, 2))
    rows = -(-cfg.vocab_size // 2)
    assert half[0].params == rows * cfg.d_model + cfg.seq_len * cfg.d_model
    assert half[-1].params == rows * cfg.d_model + 2 * cfg.d_model  # head rows + the final norm
    assert half[-1].flops == pytest.approx(whole[-1].flops / 2, rel=0.01)


def test_a_tied_embedding_counts_once_on_a_rank_holding_both_ends(cpu):
    untied = dataclasses.replace(TINY.model, tie_embeddings=False)
    plan = Candidate(1, 1, 1, "1f1b", 1, 2, 8, "fp32", False)
    args = dict(cluster=dataclasses.replace(cpu, memory_per_node=2**40), validate=lambda c: None,
                model_flops_per_token=1.0)
    tied_memory = estimate(plan, cfg=TINY.model, costs=CostTable(TINY.model), **args).memory_per_rank
    untied_memory = estimate(plan, cfg=untied, costs=CostTable(untied), **args).memory_per_rank
    assert untied_memory - tied_memory == pytest.approx(16 * TINY.model.vocab_size * TINY.model.d_model)


def test_every_schedule_is_searched_and_v_placements_price_both_ends_on_rank_zero(tiny_plans, cpu):
    feasible = {e.candidate.schedule for e in tiny_plans if e.feasible}
    assert {"zbv", "dualpipev", "looped-bfs"} <= feasible
    # DualPipeV needs m >= 2p: the engine's validation, which the planner asks, turns the rest away.
    short = [e for e in tiny_plans if e.candidate.schedule == "dualpipev" and e.candidate.pp == 2
             and e.candidate.microbatches < 4]
    assert short and all(not e.feasible and "--microbatches" in e.reason for e in short)
    # Under a V, pp rank 0 holds the embedding and the head: with a heavy head its split gives rank 0 fewer
    # blocks than the looped placement's rank-by-rank split would.
    heavy = dataclasses.replace(TINY.model, vocab_size=8192, n_layers=8)
    costs = CostTable(heavy)
    looped, v = costs.split("fp32", 1, 4, "loop"), costs.split("fp32", 1, 4, "v")
    assert v[0] + v[3] < v[1] + v[2] and v != looped


def test_cpu_plan_json_has_the_gpu_plans_keys_and_prices_a_given_plan(tmp_path):
    cluster = tmp_path / "cluster.json"  # a file of its own: planning for that machine, no CPU identity check
    cluster.write_text((PRESET_DIR / "cpu-2core.json").read_text())
    out = tmp_path / "best.json"
    argv = ["--world", "4", "--model", "tiny", "--cluster", str(cluster), "--precisions", "fp32", "--global-batch-size",
            "16", "--dp", "2", "--pp", "2", "--mp", "1", "--out", str(tmp_path / "all.json"), "--json", str(out)]
    assert plan_command.main(argv) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"best", "priced", "considered"} and data["considered"] > 10
    assert set(data["best"]) == set(data["priced"]) and "hardware_tflops_per_gpu" in data["best"]
    assert (data["priced"]["dp"], data["priced"]["pp"], data["priced"]["mp"]) == (2, 2, 1)
    assert data["best"]["step_time_s"] <= data["priced"]["step_time_s"]
    assert sum(data["best"]["breakdown"].values()) == pytest.approx(data["best"]["step_time_s"])
