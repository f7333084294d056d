"""The planner on this machine: every plan it calls feasible is one the engine accepts and that fits; the
ranking is by time; ties, placements and the engine's own split are the engine's."""

from __future__ import annotations

import dataclasses
import json

import pytest

from compiler.parallel_plan import ParallelPlan
from compiler.partition import layer_split
from compiler.planner.auto import rank_plans
from compiler.planner.candidates import Constraints, dp_modes, meshes
from compiler.planner.cluster import PRESET_DIR, cpu_cluster_from_dict, load_cluster, preset_names
from compiler.planner.memory_model import DataParallelLayout, RankLoad, in_flight_stage_microbatches, rank_memory, weight_memory
from compiler.planner.search import Pricer, search
from compiler.planner.shape import DecoderShape
from compiler.planner.split import v_split
from compiler.schedules import SCHEDULES
from compiler.stage_plan import plan_stages
from models import named_config
from runtime.commands import plan as plan_command
from runtime.commands.flags import default_config
from runtime.config import plan_checker, plan_error

TINY = default_config(named_config("tiny"))


@pytest.fixture(scope="module")
def cpu():
    return load_cluster("cpu-2core")


@pytest.fixture(scope="module")
def tiny_plans(cpu):
    return rank_plans(TINY.model, validate=plan_checker(TINY), world=4, global_batch_size=16, cluster=cpu,
                      precisions=("fp32", "bf16"))


def test_meshes_multiply_to_the_world():
    assert sorted(meshes(4)) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]


def test_every_feasible_plan_is_accepted_by_the_engine_and_fits(tiny_plans, cpu):
    feasible = [e for e in tiny_plans if e.feasible]
    assert feasible
    for e in feasible:
        c = e.plan
        assert c.dp * c.pp * c.mp == 4 and c.cp == 1 and c.ep == 1
        assert plan_error(TINY, c) is None
        assert e.memory_per_rank <= cpu.memory_per_rank(4)
        assert e.step_time > 0 and e.tokens_per_sec > 0 and 0 < e.mfu


def test_context_parallel_ranks_shard_the_parameters_at_dp_1_with_or_without_resharding(cpu):
    """FSDP runs over dp x cp: at dp 1, cp 2 the search offers ZeRO-3 too, and the engine accepts it."""
    assert dp_modes(1) == [(None, False)] and dp_modes(1, cp=2) == [(None, False), (None, True)]
    llama = default_config(named_config("llama3-debug", seq_len=256))
    plans = search(DecoderShape.from_config(llama.model), world=2, global_batch_size=2, cluster=cpu,
                   constraints=Constraints(dp=1, cp=2, pp=1, mp=1), keep=8, collect=True).every
    zero3 = [e.plan for e in plans if e.plan.reshard_after_forward]
    assert zero3 and all(c.dp_mode == "zero3" for c in zero3)
    assert {e.plan.dp_mode for e in plans} == {"fsdp", "zero3"}
    assert plan_error(llama, dataclasses.replace(zero3[0], chunked_loss=True)) is None


def test_infeasible_plans_say_why(tiny_plans):
    infeasible = [e for e in tiny_plans if not e.feasible]
    assert infeasible and all(e.reason for e in infeasible)
    short = [e for e in infeasible if e.plan.schedule == "dualpipev" and e.plan.microbatches < 4]
    assert short and all("micro-batches" in e.reason for e in short)  # DualPipeV needs m >= 2p


def test_ranking_is_fastest_first_and_feasible_first(tiny_plans):
    times = [e.step_time for e in tiny_plans if e.feasible]
    assert times == sorted(times)
    flags = [e.feasible for e in tiny_plans]
    assert flags == sorted(flags, reverse=True)


def test_sequence_parallel_plans_are_proposed_and_accepted(tiny_plans):
    sp = [e for e in tiny_plans if e.feasible and e.plan.sequence_parallel]
    assert sp and all(e.plan.mp > 1 for e in sp)


def test_a_small_memory_budget_makes_plans_infeasible(cpu):
    small = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, memory_per_node=2**20))
    plans = rank_plans(TINY.model, validate=plan_checker(TINY), world=2, global_batch_size=16, cluster=small,
                       precisions=("fp32",))
    assert plans and not any(e.feasible for e in plans)
    assert any(e.reason.startswith("out of memory") for e in plans)


def test_in_flight_micro_batches_per_schedule():
    assert in_flight_stage_microbatches("gpipe", p=4, m=8, v=1) == 8
    assert in_flight_stage_microbatches("1f1b", p=4, m=8, v=1) == 4
    assert in_flight_stage_microbatches("1f1b", p=4, m=8, v=1, rank=3) == 1
    # torch's interleaved warm-up for rank 0: (v-1) * m_round + 2 (p-1) forwards, plus the one in flight.
    assert in_flight_stage_microbatches("interleaved-1f1b", p=4, m=8, v=2) == 4 + 6 + 1


def test_the_heads_activations_are_held_by_the_last_stage_alone():
    """The last stage runs its backward right after its forward (all m at once only under GPipe and looped BFS):
    on an interleaved rank the head's saved bytes count once, the blocks' per in-flight stage-micro-batch."""
    assert SCHEDULES["interleaved-1f1b"].last_stage_in_flight(8) == 1 and SCHEDULES["zbv"].last_stage_in_flight(8) == 1
    assert SCHEDULES["gpipe"].last_stage_in_flight(8) == 8 and SCHEDULES["looped-bfs"].last_stage_in_flight(8) == 8
    load = RankLoad(dense_params=0, expert_params=0, largest_unit=0, saved_bytes=100.0 + 40.0, recompute_bytes=0,
                    transient_bytes=0, weight_copy_bytes=0, blocks=2, head_saved_bytes=40.0)
    none = DataParallelLayout()
    in_flight = in_flight_stage_microbatches("interleaved-1f1b", p=4, m=8, v=2, rank=3)
    m = rank_memory(load, schedule="interleaved-1f1b", p=4, m=8, v=2, rank=3, dense=none, experts=none)
    assert m.activations == pytest.approx(in_flight * 100.0 / 2 + 40.0)
    m = rank_memory(load, schedule="gpipe", p=4, m=8, v=1, rank=3, dense=none, experts=none)
    assert m.activations == pytest.approx(8 * 140.0)  # GPipe: every micro-batch of the one stage


def test_presets_load():
    names = preset_names()
    assert {"cpu-2core", "a100-80gb", "h100-80gb", "h100-80gb-4x8-ib", "h200-141gb"} <= set(names)
    for name in names:
        cluster = load_cluster(name)
        assert {"fp32", "bf16", "fp16"} <= set(cluster.device.peak_flops) and cluster.source
        assert json.loads(cluster.to_json())  # writes back in its own format
        if not cluster.is_gpu:  # ... and reads back the same device, attention rates included
            assert cpu_cluster_from_dict(json.loads(cluster.to_json())).device == cluster.device
    assert load_cluster("cpu-2core").device.attention_points


def test_rescaled_cluster_scales_every_predicted_step_time(cpu):
    """The speed probe's correction: a machine measured twice as slow predicts every plan twice as slow."""
    slow = cpu.rescaled(2.0, "test")
    fast = rank_plans(TINY.model, validate=plan_checker(TINY), world=4, global_batch_size=16, cluster=cpu, precisions=("fp32",))
    slower = {e.plan: e.step_time for e in rank_plans(TINY.model, validate=plan_checker(TINY), world=4,
                                                      global_batch_size=16, cluster=slow,
                                                             precisions=("fp32",)) if e.feasible}
    feasible = [e for e in fast if e.feasible]
    assert feasible and len(slower) == len(feasible)
    for e in feasible:
        assert slower[e.plan] == pytest.approx(2 * e.step_time, rel=1e-9)


def test_weight_memory_by_data_parallel_mode():
    params, block = 1_000_000, 100_000
    replicate = weight_memory(params, block, DataParallelLayout(dp=4, shard=1))
    fsdp = weight_memory(params, block, DataParallelLayout(dp=4, shard=4))
    hsdp = weight_memory(params, block, DataParallelLayout(dp=4, shard=2))
    zero3 = weight_memory(params, block, DataParallelLayout(dp=4, shard=4, zero3=True))
    gathered_bf16 = weight_memory(params, block, DataParallelLayout(dp=4, shard=4, gather_bytes=2))
    one_microbatch = weight_memory(params, block, DataParallelLayout(dp=4, shard=4), accumulate=False)
    assert weight_memory(params, block, DataParallelLayout()) == 16 * params
    assert replicate == 20 * params  # + the buckets' flat gradient copies
    assert fsdp == params * (12 / 4 + 4 + 4)  # shards (no sharded gradient yet) + gathered parameters + unsharded gradients
    assert one_microbatch == params * (12 / 4 + 4) + 2 * block * 4  # gradients reduce-scattered unit by unit
    assert zero3 < fsdp < hsdp < replicate and gathered_bf16 == fsdp - 2 * params


def test_dp_modes_are_planned_and_accepted():
    assert set(dp_modes(4)) == {(None, False), (None, True), (1, False), (2, False)}
    modes = {(e.plan.dp_shard, e.plan.reshard_after_forward)
             for e in rank_plans(TINY.model, validate=plan_checker(TINY), world=4, global_batch_size=16,
                                 cluster=load_cluster("cpu-2core"),
                                 precisions=("fp32",)) if e.feasible and e.plan.dp == 4}
    assert modes == set(dp_modes(4))


def test_a_tied_embedding_counts_once_on_a_rank_holding_both_ends(cpu):
    """The tied table is the only difference between the two models on one rank: 16 bytes per element of it,
    no more (the old CPU planner added back seq_len x d of phantom position parameters for tied Llamas)."""
    plan = ParallelPlan(dp=1, pp=1, mp=1, schedule="1f1b", stages_per_rank=1, microbatches=2, micro_batch_size=8,
                        precision="fp32", chunked_loss=False)
    for cfg in (TINY.model, named_config("llama3-debug")):
        untied = dataclasses.replace(cfg, tie_embeddings=False)
        tied_memory = Pricer(DecoderShape.from_config(cfg), cpu).price(plan).memory_per_rank
        untied_memory = Pricer(DecoderShape.from_config(untied), cpu).price(plan).memory_per_rank
        copies = cfg.vocab_size * cfg.d_model * (4 if plan.precision != "fp32" else 0)
        assert untied_memory - tied_memory == pytest.approx(16 * cfg.vocab_size * cfg.d_model + copies)


@pytest.mark.parametrize("schedule, pp, v", [("1f1b", 2, 1), ("interleaved-1f1b", 2, 2), ("zbv", 2, 2),
                                             ("dualpipev", 2, 2), ("interleaved-1f1b", 4, 2)])
def test_the_planners_split_is_the_engines(schedule, pp, v):
    """What the planner prices is what compiler/stage_plan.py cuts (--split auto), placement-aware: a heavy head
    sits on rank 0 beside a light first stage under a V."""
    cfg = named_config("tiny", vocab_size=8192, n_layers=8)
    placement = "v" if schedule in ("zbv", "dualpipev") else "loop"
    engine = plan_stages(cfg, n_stages=pp * v, micro_batch_size=2, split="auto", precision="bf16", mp=2,
                         placement=placement).blocks_per_stage
    planner = Pricer(DecoderShape.from_config(cfg), load_cluster("cpu-2core")).split(pp * v, placement)
    assert list(planner) == engine
    if placement == "v":
        assert engine[0] + engine[-1] < engine[1] + engine[-2]


def test_large_v_splits_reach_the_exact_busiest_pair_on_uniform_blocks():
    """Beyond compiler/planner/split.py's EXACT_V_ITEMS the planner bisects the busiest pair: on a decoder's
    costs (equal blocks, a light embedding, a heavy head) it reaches the exact programme's value."""
    for blocks, head, pp in ((20, 3.0, 4), (30, 7.5, 5), (24, 1.0, 6)):
        costs = [0.0] + [1.0] * blocks + [head]
        exact = layer_split(costs, 2 * pp, placement="v")
        fast = v_split(costs, pp)
        fast = [fast[0] - 1, *fast[1:-1], fast[-1] - 1]

        def busiest(sizes):
            items = [sizes[0] + 1, *sizes[1:-1], sizes[-1] + 1]
            bounds = [sum(items[:i]) for i in range(len(items) + 1)]
            stage = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
            return max(stage[r] + stage[2 * pp - 1 - r] for r in range(pp))
        assert busiest(fast) == pytest.approx(busiest(exact))


def test_cpu_plan_json_has_the_gpu_plans_keys_and_prices_a_given_plan(tmp_path):
    cluster = tmp_path / "cluster.json"  # a file of its own: planning for that machine, no CPU identity check
    cluster.write_text((PRESET_DIR / "cpu-2core.json").read_text())
    out = tmp_path / "best.json"
    argv = ["--world", "4", "--model", "tiny", "--cluster", str(cluster), "--precisions", "fp32", "--global-batch-size",
            "16", "--dp", "2", "--pp", "2", "--mp", "1", "--out", str(tmp_path / "all.json"), "--json", str(out)]
    assert plan_command.main(argv) == 0
    data = json.loads(out.read_text())
    assert {"best", "priced", "considered", "binding"} <= set(data) and data["considered"] > 10
    assert set(data["best"]) == set(data["priced"]) and "hardware_tflops_per_gpu" in data["best"]
    assert (data["priced"]["dp"], data["priced"]["pp"], data["priced"]["mp"]) == (2, 2, 1)
    assert data["best"]["step_time_s"] <= data["priced"]["step_time_s"]
    assert sum(data["best"]["breakdown"].values()) == pytest.approx(data["best"]["step_time_s"])


def test_a_priced_layout_holds_what_the_user_gave(cpu):
    """--dp --pp --mp with a micro-batch, schedule, DP mode and checkpointing: the priced plan is that run."""
    shape = DecoderShape.from_config(TINY.model)
    given = Constraints(dp=2, pp=2, mp=1, micro_batch_size=2, schedule="1f1b", ac="full", dp_mode="replicate",
                        cp=1, ep=1, chunked_loss=False)
    best = search(shape, world=4, global_batch_size=16, cluster=cpu, precisions=("fp32",), constraints=given).best
    c = best.plan
    assert (c.dp, c.pp, c.mp, c.micro_batch_size, c.schedule, c.ac, c.dp_shard) == (2, 2, 1, 2, "1f1b", "full", 1)
    assert c.microbatches == 16 // 2 // 2


def test_the_cpu_measured_tensor_parallel_buffers_are_charged_on_a_cpu_only():
    """DTensor's two extra [B, T, d] fp32 buffers per block and in-flight micro-batch were measured on this CPU;
    the GPU device charges none (issue 38: they made Llama 3 405B need ZeRO-3 on 80 GB)."""
    shape = DecoderShape.from_config(TINY.model)
    plan = ParallelPlan(dp=1, pp=2, mp=2, schedule="1f1b", stages_per_rank=1, microbatches=4, micro_batch_size=8,
                        precision="fp32", chunked_loss=False)
    cpu, gpu = load_cluster("cpu-2core"), load_cluster("h100-80gb")
    in_flight = in_flight_stage_microbatches("1f1b", p=2, m=4, v=1)
    blocks = Pricer(shape, cpu).holdings("1f1b", 2, 1)
    first = next(h for h, r in blocks.items() if r == 0)
    extra = 2 * 8 * shape.seq_len * shape.d_model * 4 * first.blocks * in_flight
    assert Pricer(shape, cpu).rank_memories(plan)[0] - Pricer(shape, gpu).rank_memories(plan)[0] == pytest.approx(extra)
