"""The planner on GPU clusters: cluster files, the device -> preset map, the search (exact under its pruning,
fast at 16,384 GPUs), a priced layout is the run it names, and ``run.py plan``'s JSON and advice."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections import Counter

import pytest
import torch

from compiler.parallelize.cross_entropy import ACCELERATOR_CHUNK_BYTES, CPU_CHUNK_BYTES
from compiler.planner import pricer as pricer_module
from compiler.planner.activations import head_memory
from compiler.planner.candidates import Constraints
from compiler.planner.cluster import gpu_cluster_from_dict, load_cluster, preset_for_device, resolve_cluster
from compiler.planner.devices import GemmEfficiency
from compiler.planner.search import Pricer, search
from compiler.planner.shape import DecoderShape
from compiler.schedules import bubble_fraction
from models import named_config
from models.spec import Experts
from runtime.commands import auto
from runtime.commands import plan as plan_command
from runtime.commands.flags import build_parser

NODE = {"devices_per_node": 8, "memory_gib": 80, "peak_tflops": {"bf16": 312, "fp16": 312, "fp32": 19.5},
        "intra_node_gb_per_s": 300, "inter_node_gb_per_s": 25}
LLAMA_405B = DecoderShape.from_flags(layers=126, d_model=16384, heads=128, kv_heads=8, mlp_width=53248, mlp="swiglu",
                                     seq_len=8192, vocab_size=128256)
MOE = DecoderShape.from_flags(layers=16, d_model=2048, heads=16, kv_heads=4, mlp="swiglu", mlp_width=6144,
                              seq_len=4096, vocab_size=32000, experts=Experts(64, 8, 1024, 1, dense_layers=(0,)))


def test_cluster_files_need_the_required_keys_and_take_documented_defaults(tmp_path):
    cluster = gpu_cluster_from_dict(NODE, default_name="mine")
    assert cluster.name == "mine" and cluster.topology.nodes is None and cluster.topology.efficiency == 0.8
    assert cluster.device.peak_flops["fp16"] == 312e12 and cluster.topology.inter.bandwidth == 25e9
    for key in NODE:
        with pytest.raises(ValueError, match=key):
            gpu_cluster_from_dict({k: v for k, v in NODE.items() if k != key}, default_name="x")
    with pytest.raises(ValueError, match="peak_tflops"):
        gpu_cluster_from_dict({**NODE, "peak_tflops": {"bf16": 1}}, default_name="x")
    with pytest.raises(ValueError, match="unknown key"):
        gpu_cluster_from_dict({**NODE, "memory_gb": 80}, default_name="x")
    with pytest.raises(ValueError, match="gemm must be an object with max_efficiency"):
        gpu_cluster_from_dict({**NODE, "gemm": {"max_eff": 0.5}}, default_name="x")  # never silently the default
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**NODE, "nodes": 2, "gemm": {"max_efficiency": 0.5}, "compute_scale": 1.4}))
    loaded = load_cluster(str(path))
    assert loaded.is_gpu and loaded.device.gemm.max_efficiency == 0.5 and loaded.device.gemm.k_half == 128
    assert loaded.factors.compute_scale == 1.4  # fitted factors live in the same file
    assert loaded.world_error(16) is None and "exceeds" in loaded.world_error(24)
    assert "multiple" in gpu_cluster_from_dict(NODE, default_name="x").world_error(12)
    assert load_cluster(str(path)).to_json() == loaded.to_json()


def test_a_cluster_file_states_cudnn_attentions_speed_over_flash_attention():
    cluster = gpu_cluster_from_dict({**NODE, "fused_attention_speedup": {"forward": 1.5, "backward": 1.25}},
                                    default_name="x")
    assert cluster.device.fused_attention_speedup == (1.5, 1.25)
    again = gpu_cluster_from_dict(json.loads(cluster.to_json()), default_name="x")  # written back, read again
    assert again.device == cluster.device
    assert gpu_cluster_from_dict(NODE, default_name="x").device.fused_attention_speedup is None
    for bad in ({"forward": 1.5}, {"forward": 1.5, "backward": 0}, {"forward": "fast", "backward": 1.2}, 1.6):
        with pytest.raises(ValueError, match="fused_attention_speedup must be an object with positive forward"):
            gpu_cluster_from_dict({**NODE, "fused_attention_speedup": bad}, default_name="x")


def test_the_gemm_curve_is_fitted_back_from_measured_points():
    truth = GemmEfficiency(max_efficiency=0.74, k_half=96)
    fitted = GemmEfficiency.fit([(k, truth.efficiency(k)) for k in (64, 128, 512, 4096, 16384)])
    assert fitted.max_efficiency == pytest.approx(0.74) and fitted.k_half == pytest.approx(96)
    with pytest.raises(ValueError, match="two or more"):
        GemmEfficiency.fit([(128, 0.5), (128, 0.6)])


def test_a_cuda_machine_defaults_to_its_gpus_preset_and_auto_uses_the_same_planner(monkeypatch):
    assert preset_for_device("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert preset_for_device("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert preset_for_device("NVIDIA H200") == "h200-141gb" and preset_for_device("NVIDIA H200 NVL") is None
    assert preset_for_device("NVIDIA H100 PCIe") is None and preset_for_device("NVIDIA A100-SXM4-40GB") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert resolve_cluster(None).name == load_cluster("h100-80gb-engine").name  # this engine's fitted factors
    assert resolve_cluster(None).factors.compute_scale > 1
    assert not resolve_cluster("cpu-2core").is_gpu  # an explicit --cluster still wins
    argv = ["--auto", "--model", "tiny", "--precision", "bf16"]
    cfg, best, notes = auto.auto_config(build_parser().parse_args(argv), argv, world=8)
    assert cfg.plan.dp * cfg.plan.pp * cfg.plan.mp == 8 and best.fits and "H100" in notes[-1]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Mystery 99GB")
    with pytest.raises(ValueError, match="no cluster preset matches"):
        resolve_cluster(None)


def test_looped_bubble_with_fewer_micro_batches_than_ranks():
    assert bubble_fraction("interleaved-1f1b", p=4, m=8, v=2) == pytest.approx(3 / 19)  # the paper's formula
    assert bubble_fraction("looped-bfs", p=2, m=1, v=8) == pytest.approx(0.5)  # one micro-batch: ranks alternate
    assert bubble_fraction("looped-bfs", p=4, m=2, v=1) == pytest.approx(3 / 5)  # GPipe's (p-1)/(m+p-1)


@pytest.mark.parametrize("shape", [DecoderShape.from_config(named_config("medium")), MOE], ids=["dense", "moe"])
def test_pruned_search_finds_the_exhaustive_best(shape):
    cluster = load_cluster("a100-80gb")
    args = dict(world=8 if shape.experts else 16, global_batch_size=32, cluster=cluster, precisions=("bf16",))
    pruned, everything = search(shape, **args), search(shape, collect=True, **args)
    assert pruned.priced < everything.priced
    assert pruned.best.step_time == everything.best.step_time
    assert all(e.fits for e in everything.top)


_EVERY_PLAN = dict(world=8, global_batch_size=32, cluster=load_cluster("a100-80gb"), precisions=("bf16",), collect=True)


@functools.cache
def _every_moe_plan():
    return search(MOE, **_EVERY_PLAN)


@pytest.mark.parametrize("fixed", [
    Constraints(dp_mode="zero3", schedule="interleaved-1f1b", stages_per_rank=2, ac="selective"),
    Constraints(ep=2, micro_batch_size=2, sequence_parallel=True, chunked_loss=True, precision="bf16"),
    Constraints(dp_mode="hsdp:2", schedule=("1f1b", "zbv")),
], ids=["schedule-mode-ac", "ep-mbs-sp-loss", "hsdp-schedules"])
def test_the_search_holds_exactly_the_plans_the_constraints_admit(fixed):
    """Constraints are applied by group, schedule and DP mode before any plan is built (a large search builds
    only the plans of the groups it prices): the plans held are those of the whole space that ``admits`` keeps."""
    held = search(MOE, constraints=fixed, **_EVERY_PLAN)
    everything = _every_moe_plan()
    key = lambda e: dataclasses.astuple(e.plan)  # noqa: E731
    assert held.every and held.considered == len(held.every)
    assert Counter(map(key, held.every)) == Counter(key(e) for e in everything.every if fixed.admits(e.plan))


def test_a_search_for_plans_faster_than_a_step_finds_the_fastest_or_none():
    """``plan``'s binding-constraint search asks only for plans faster than the best fitting one."""
    args = dict(world=8, global_batch_size=32, cluster=load_cluster("a100-80gb"), precisions=("bf16",),
                require_fit=False)
    fastest = search(MOE, **args)
    assert search(MOE, faster_than=fastest.best.step_time * 1.01, **args).best == fastest.best
    slower = search(MOE, faster_than=fastest.best.step_time, **args)
    assert slower.best is None and slower.priced < fastest.priced


def test_a_16384_gpu_search_for_a_405b_gqa_swiglu_shape_is_fast():
    """The issue's bound is 60 s on this 2-core machine (shared with other work: CPU time, not wall time)."""
    start = time.process_time()
    result = search(LLAMA_405B, world=16384, global_batch_size=2048, cluster=load_cluster("h100-80gb"))
    seconds = time.process_time() - start
    assert result.best is not None and result.best.fits and result.considered > 10_000
    assert result.best.plan.mp <= 8 and result.best.memory_per_rank <= 77 * 2**30
    assert seconds < 60, f"{seconds:.1f} s"


def test_a_moe_search_considers_expert_parallelism_and_ep_trades_memory_for_all_to_alls():
    cluster = load_cluster("h100-80gb")
    result = search(MOE, world=64, global_batch_size=256, cluster=cluster, keep=200)
    assert {e.plan.ep for e in result.top} > {1}
    one = search(MOE, world=64, global_batch_size=256, cluster=cluster,
                 constraints=Constraints(ep=1, dp=64, micro_batch_size=4, ac="none", dp_mode="fsdp"),
                 require_fit=False).best  # priced whether or not it fits: the comparison is what ep changes
    eight = Pricer(MOE, cluster).price(dataclasses.replace(one.plan, ep=8))
    assert eight.memory_per_rank < one.memory_per_rank and eight.breakdown.ep > 0 == one.breakdown.ep


def test_plan_json_and_a_priced_plan(tmp_path, run_main):
    out = tmp_path / "plan.json"
    argv = ["--world", "64", "--cluster", "a100-80gb", "--layers", "24", "--d-model", "2048", "--heads", "16",
            "--kv-heads", "4", "--mlp", "swiglu", "--seq-len", "2048", "--vocab-size", "32000",
            "--global-batch-size", "256", "--dp", "8", "--pp", "2", "--mp", "4", "--micro-batch-size", "2",
            "--json", str(out)]
    run = run_main(plan_command.main, argv)
    assert run.code == 0, run.err
    data = json.loads(out.read_text())
    assert {"best", "priced", "considered", "binding", "advice"} <= set(data) and data["considered"] > 0
    keys = {"dp", "pp", "mp", "cp", "ep", "schedule", "stages_per_rank", "micro_batch_size", "activation_checkpointing",
            "sequence_parallel", "chunked_loss", "dp_mode", "precision", "fp8", "fp8_all_gather", "cp_gather", "step_time_s",
            "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu", "memory_gib_per_gpu", "fits", "breakdown"}
    assert set(data["best"]) == set(data["priced"]) == keys
    priced, best = data["priced"], data["best"]
    assert (priced["dp"], priced["pp"], priced["mp"], priced["micro_batch_size"]) == (8, 2, 4, 2)
    assert best["step_time_s"] <= priced["step_time_s"]
    assert sum(best["breakdown"].values()) == pytest.approx(best["step_time_s"])
    assert best["mfu"] == pytest.approx(best["model_tflops_per_gpu"] / 312)
    assert "binding constraint" in run.out and data["binding"]
    # A world beyond a bounded cluster file is an error, not time-sharing.
    code, _, err = run_main(plan_command.main, ["--world", "4096", "--cluster", "h100-80gb-4x8-ib"])
    assert code == 2 and "exceeds" in err


@pytest.mark.parametrize(("fixed", "why"), [
    (["--pp", "4", "--schedule", "zbv", "--stages-per-rank", "3"], "zbv at pp 4 runs v in [2], not 3"),
    (["--pp", "8", "--stages-per-rank", "8"], "too few layers for pp x v stages"),
    (["--dp", "16", "--micro-batch-size", "3"], "micro-batch 3 does not divide a replica's 4 sequences"),
    (["--mp", "16"], "3 x --mp 16 must divide --kv-heads 8"),
])
def test_a_named_layout_no_plan_matches_says_which_value_rules_it_out(run_main, fixed, why):
    argv = ["--world", "64", "--cluster", "h100-80gb", "--model", "llama3-8b", "--global-batch-size", "64", *fixed]
    code, out, err = run_main(plan_command.main, argv)
    assert code == 0, err
    assert f"priced: no plan matches --dp/--pp/--mp/... here: {why}\n" in out


@pytest.mark.parametrize(("vocab", "mp", "padded"), [("50257", "1", "50304"), ("50257", "2", "50304"),
                                                     ("50304", "1", None), ("32000", "4", None)])
def test_a_gpu_plan_whose_head_is_unaligned_prices_the_padded_vocabulary(tmp_path, run_main, vocab, mp, padded):
    """GPT-2's 50,257 words: the head's products run on unaligned kernels (compiler/planner/devices.py); plan
    names --vocab-size padded to a multiple of 64 x mp and prices it, faster."""
    out = tmp_path / "p.json"
    argv = ["--world", "8", "--cluster", "h100-80gb", "--model", "small", "--vocab-size", vocab, "--mp", mp,
            "--global-batch-size", "64", "--json", str(out)]
    run = run_main(plan_command.main, argv)
    assert run.code == 0, run.err
    line, best = json.loads(out.read_text())["vocabulary"], json.loads(out.read_text())["best"]
    if padded is None:
        assert line is None
        return
    assert line in run.out and f"--vocab-size {padded}:" in line
    speedup = float(line.rsplit(", ", 1)[1].split("x")[0])
    assert speedup > 1.2  # the head's three products at 1 / unaligned_slowdown of the rate, then at the full rate
    argv[argv.index("--vocab-size") + 1] = padded
    assert plan_command.main(argv) == 0
    assert json.loads(out.read_text())["best"]["step_time_s"] == pytest.approx(best["step_time_s"] / speedup, rel=0.01)


def test_a_plan_that_does_not_fit_is_priced_says_so_and_names_the_cheapest_change(tmp_path, capsys):
    result = search(LLAMA_405B, world=64, global_batch_size=64, cluster=load_cluster("h100-80gb"),
                     constraints=Constraints(dp=8, pp=1, mp=8))
    assert result.best is None and result.infeasible["out of memory"] > 0
    forced = search(LLAMA_405B, world=64, global_batch_size=64, cluster=load_cluster("h100-80gb"),
                    constraints=Constraints(dp=8, pp=1, mp=8), require_fit=False)
    assert forced.best is not None and not forced.best.fits and forced.best.memory_per_rank > 80 * 2**30
    out = tmp_path / "p.json"
    argv = ["--world", "64", "--cluster", "h100-80gb", "--model", "llama3-70b", "--global-batch-size", "64",
            "--dp", "8", "--pp", "1", "--mp", "8", "--activation-checkpointing", "none", "--json", str(out)]
    assert plan_command.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["priced"]["fits"] is False and data["advice"] and "add" in data["advice"]


@pytest.mark.parametrize("preset, chunk_bytes", [("h100-80gb", ACCELERATOR_CHUNK_BYTES),
                                                 ("cpu-2core", CPU_CHUNK_BYTES)])
def test_the_loss_chunks_priced_are_the_ones_the_engine_upcasts_on_that_device(monkeypatch, preset, chunk_bytes):
    contexts = []
    monkeypatch.setattr(pricer_module, "head_memory", lambda shape, c: contexts.append(c) or head_memory(shape, c))
    shape = DecoderShape.from_flags(layers=4, d_model=512, heads=8, seq_len=1024, vocab_size=50257)
    cluster = load_cluster(preset)
    c = search(shape, world=1, global_batch_size=8, cluster=cluster,
               constraints=Constraints(dp=1, pp=1, mp=1, micro_batch_size=8, chunked_loss=True)).best.plan
    contexts.clear()
    Pricer(shape, cluster).rank_memories(c)
    assert contexts and {x.loss_chunk_bytes for x in contexts} == {chunk_bytes}


def test_the_h800_preset_is_an_h100_with_its_nvlink_cut():
    """H800 (DeepSeek-V3's cluster): the H100's compute and memory, 400 GB/s NVLink (200 each way) instead of 900."""
    h100, h800 = load_cluster("h100-80gb"), load_cluster("h800-80gb")
    assert h800.device == h100.device
    assert h800.topology.intra.bandwidth == pytest.approx(h100.topology.intra.bandwidth * 200 / 450)
    assert h800.topology.inter == h100.topology.inter
