"""The planner's --cp-gather (compiler/planner/search.py ``cp_gather_choices``): for latent attention under context
parallelism without FP8 the search prices gathering the latent and gathering the keys and values and keeps the faster,
unless the flag holds one; elsewhere there is one path (``auto``). The shape is runtime/lab/latent_cp_benchmark.py's:
DeepSeek-V3's attention with 16 heads at d 1024, T 2048, one block."""

from __future__ import annotations

import dataclasses

import pytest

from compiler.planner.candidates import Constraints
from compiler.planner.cluster import load_cluster
from compiler.planner.search import Pricer, search
from compiler.planner.shape import DecoderShape
from models import named_config

BENCHMARK = DecoderShape.from_config(dataclasses.replace(
    named_config("deepseek-v3"), n_layers=1, first_k_dense=1, n_heads=16, d_model=1024, seq_len=2048, q_lora_rank=384,
    vocab_size=256, mlp_width=256))
PRECISION = {"cpu-2core": "fp32", "h100-80gb": "bf16"}


def _search(cluster: str, shape: DecoderShape = BENCHMARK, *, cp: int = 2, **held):
    """The search of one block of ``shape`` at world cp (all of it context-parallel) on ``cluster``, ``held`` fixed."""
    return search(shape, world=cp, global_batch_size=4, cluster=load_cluster(cluster), precisions=(PRECISION[cluster],),
                  constraints=Constraints(cp=cp, max_cp=cp, **held))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("cluster", ["cpu-2core", "h100-80gb"])
def test_the_search_keeps_the_cheaper_of_the_latent_and_the_keys_and_values(cluster, cp):
    result = _search(cluster, cp=cp)
    best = result.best.plan
    assert best.cp_gather in ("latent", "kv")
    pricer = Pricer(BENCHMARK, load_cluster(cluster))
    times = {g: pricer.price(dataclasses.replace(best, cp_gather=g)).step_time for g in ("latent", "kv")}
    assert times["latent"] != times["kv"]  # the two paths are priced apart (kv_b's rows, the gathered bytes)
    assert best.cp_gather == min(times, key=times.get) and result.best.step_time == pytest.approx(min(times.values()))
    # the latent path holds the gathered latent kv_b keeps for its weight's gradient beside the expanded K and V
    latent, kv = (max(pricer.memory(dataclasses.replace(best, cp_gather=g))) for g in ("latent", "kv"))
    assert latent > kv
    held = _search(cluster, cp=cp, cp_gather=(best.cp_gather,))
    assert held.considered * 2 == result.considered  # both were in the space: each group once per choice


@pytest.mark.parametrize("choice", ["latent", "kv", "auto"])
def test_a_held_choice_is_the_plan_s(choice):
    assert _search("cpu-2core", cp_gather=(choice,)).best.plan.cp_gather == choice


def test_one_path_is_auto_without_latent_attention_at_cp_1_or_under_fp8():
    llama = DecoderShape.from_config(named_config("llama3-debug"))
    assert _search("cpu-2core", llama).best.plan.cp_gather == "auto"
    assert _search("cpu-2core", cp=1).best.plan.cp_gather == "auto"
    fp8 = _search("h100-80gb", fp8=("tensorwise",)).best.plan
    assert (fp8.fp8, fp8.cp_gather) == ("tensorwise", "auto")
    assert _search("h100-80gb", fp8=(None, "tensorwise"), cp_gather=("latent",)).best.plan.fp8 is None  # held latent


def test_a_held_latent_no_plan_can_run_is_refused_in_train_words():
    llama = DecoderShape.from_config(named_config("llama3-debug"))
    with pytest.raises(ValueError, match="^--cp-gather latent needs multi-head latent attention"):
        _search("cpu-2core", llama, cp_gather=("latent",))
    with pytest.raises(ValueError, match="^--cp-gather latent cannot run with --fp8"):
        _search("h100-80gb", fp8=("tensorwise",), cp_gather=("latent",))
