"""The planner's FP8 (--fp8): products at the preset's FP8 peak, the quantizers' memory traffic, FP8 all-gather bytes
for engines that gather FP8 weights, a recipe chosen only when asked, and no FP8 on a GPU without FP8 units."""

from __future__ import annotations

import dataclasses

import pytest

from compiler.parallel_plan import ParallelPlan
from compiler.planner.candidates import Constraints
from compiler.planner.cluster import resolve_cluster
from compiler.planner.engines import THIS_ENGINE
from compiler.planner.search import Pricer, search
from compiler.planner.shape import DENSE, DecoderShape, attention_matrices, mlp_matrices
from compiler.planner.step import data_parallel_seconds
from compiler.planner.work import block_work
from runtime.commands import plan as plan_command

# Llama-3-8B's block (Meta's shapes), 4 layers, T 8192
LLAMA_8B = DecoderShape.from_flags(layers=4, d_model=4096, heads=32, kv_heads=8, mlp_width=14336, mlp="swiglu",
                                   seq_len=8192, vocab_size=128256)
H100 = resolve_cluster("h100-80gb")


def _work(fp8: str | None, mp: int = 1):
    return block_work(LLAMA_8B, DENSE, micro_batch_size=1, mp=mp, cp=1, ep=1, precision="bf16", sequence_parallel=False,
                      traits=THIS_ENGINE, fp8=fp8)


@pytest.mark.parametrize("mp", [1, 4])
def test_each_fp8_product_pays_a_memory_bound_pass_over_its_operands(mp):
    """x [M, K] and W [N, K] quantized forward (bf16: read twice, 1 byte written: 5 bytes an element); backward W and
    x again and dy [M, N] once (tensorwise's one layout of dy) or twice (rowwise: per token, then per channel)."""
    rows = LLAMA_8B.seq_len
    mats = [*attention_matrices(LLAMA_8B, mp).values(), *mlp_matrices(LLAMA_8B, LLAMA_8B.mlp_width, mp).values()]
    x_w = sum(rows * k + n * k for k, n in mats) * 5
    dy = sum(rows * n for _, n in mats) * 5
    assert _work("tensorwise", mp).quantize_bytes == pytest.approx((x_w, x_w + dy))
    assert _work("rowwise", mp).quantize_bytes == pytest.approx((x_w, x_w + 2 * dy))
    assert _work(None, mp).quantize_bytes == (0.0, 0.0)


def test_fp8_products_run_at_the_fp8_peak_plus_their_quantizers():
    device = H100.device
    plain, fp8 = _work(None), _work("tensorwise")
    bf16 = device.compute(plain, "bf16")
    at_fp8 = device.compute(plain, "bf16", linear_peak=device.peak_flops["fp8"])
    quantized = device.compute(fp8, "bf16", linear_peak=device.peak_flops["fp8"])
    assert at_fp8.forward < bf16.forward and at_fp8.backward < bf16.backward  # 1979 vs 989 TFLOP/s on the products
    assert quantized.forward - at_fp8.forward == pytest.approx(device.memory_seconds(fp8.quantize_bytes[0]))
    assert quantized.backward - at_fp8.backward == pytest.approx(device.memory_seconds(fp8.quantize_bytes[1]))
    plan = ParallelPlan(dp=8, micro_batch_size=1, microbatches=4, precision="bf16", schedule="1f1b")
    pricer = Pricer(LLAMA_8B, H100)
    with_fp8 = pricer.price(dataclasses.replace(plan, fp8="tensorwise"))
    assert with_fp8.plan.fp8 == "tensorwise" and with_fp8.step_time < pricer.price(plan).step_time
    assert with_fp8.to_json()["fp8"] == "tensorwise"


def test_the_search_chooses_fp8_only_when_asked():
    kwargs = dict(world=8, global_batch_size=32, cluster=H100, precisions=("bf16",))
    assert search(LLAMA_8B, **kwargs).best.plan.fp8 is None
    assert search(LLAMA_8B, **kwargs, constraints=Constraints(fp8=("rowwise",))).best.plan.fp8 == "rowwise"
    chosen = search(LLAMA_8B, **kwargs, constraints=Constraints(fp8=(None, "tensorwise", "rowwise", "blockwise")))
    assert chosen.best.plan.fp8 == "tensorwise"  # the least quantizer traffic at the same FP8 rate


def test_a_gpu_without_fp8_units_refuses_fp8(capsys):
    a100 = resolve_cluster("a100-80gb")
    with pytest.raises(ValueError, match="no FP8"):
        search(LLAMA_8B, world=8, global_batch_size=32, cluster=a100, constraints=Constraints(fp8=("tensorwise",)))
    assert search(LLAMA_8B, world=8, global_batch_size=32, cluster=a100).best is not None
    assert plan_command.main(["--cluster", "a100-80gb", "--world", "8", "--model", "llama3-8b", "--fp8", "any"]) == 2
    assert "error: --fp8" in capsys.readouterr().err


def test_an_engine_that_gathers_fp8_weights_moves_half_the_bytes_of_bf16():
    plan = ParallelPlan(dp=64, micro_batch_size=1, microbatches=1, precision="bf16", schedule="1f1b", fp8="tensorwise")
    cluster = resolve_cluster("h100-80gb-4x8-ib")
    strides = THIS_ENGINE.strides({"dp": 64, "pp": 1, "cp": 1, "mp": 1})

    def exposed(traits, fp8="tensorwise"):
        return data_parallel_seconds(dataclasses.replace(plan, fp8=fp8), cluster, traits, dense_params=8e9,
                                     expert_params=0, units=32, forward=0.0, backward=0.0, strides=strides)

    gathered = dataclasses.replace(THIS_ENGINE, fp8_all_gather=True)
    assert exposed(gathered) < exposed(THIS_ENGINE)
    assert exposed(gathered, fp8=None) == exposed(THIS_ENGINE, fp8=None)  # weights without FP8 products: bf16
    # this engine with --fp8-all-gather: the same bytes as an engine that always gathers FP8 (no experts here)
    asked = data_parallel_seconds(dataclasses.replace(plan, fp8_all_gather=True), cluster, THIS_ENGINE, dense_params=8e9,
                                  expert_params=0, units=32, forward=0.0, backward=0.0, strides=strides)
    assert asked == exposed(gathered)


def test_auto_holds_a_given_recipe_and_chooses_one_under_any(monkeypatch):
    """--auto on an H100 (faked): no FP8 unless asked; --fp8 X held; --fp8 any lets the planner pick one."""
    import torch

    from runtime.commands import auto
    from runtime.commands.flags import build_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    base = ["--auto", "--model", "llama3-1b", "--precision", "bf16", "--global-batch-size", "16"]
    chosen = {}
    for extra in ([], ["--fp8", "rowwise"], ["--fp8", "any"]):
        argv = [*base, *extra]
        cfg, best, _ = auto.auto_config(build_parser().parse_args(argv), argv, world=8)
        assert cfg.plan == best.plan and best.fits
        chosen[" ".join(extra)] = cfg.plan.fp8
    assert chosen == {"": None, "--fp8 rowwise": "rowwise", "--fp8 any": "tensorwise"}


def test_the_search_gathers_fp8_weights_where_the_engine_can_unless_held():
    """--fp8-all-gather leaves the products' numbers as they are: the search may take it wherever the engine runs it
    (tensorwise, sharded data parallelism), unless the flag holds it on or off."""
    from compiler.parallel_plan import fp8_all_gather_problem

    def top(**held):
        return [e.plan for e in search(LLAMA_8B, world=8, global_batch_size=32, cluster=H100, keep=8,
                                       constraints=Constraints(**held)).top]

    chosen = top(fp8=("tensorwise",))[0]
    assert chosen.fp8_all_gather and chosen.shard > 1  # less to gather, less held: where it can, it wins
    assert search(LLAMA_8B, world=8, global_batch_size=32, cluster=H100, constraints=Constraints(
        fp8=("tensorwise",))).best.to_json()["fp8_all_gather"] is True
    assert not any(c.fp8_all_gather for c in top(fp8=("tensorwise",), fp8_all_gather=(False,)))
    held = top(fp8=("tensorwise",), fp8_all_gather=(True,))
    assert held and all(c.fp8_all_gather and fp8_all_gather_problem(c) is None for c in held)
    for refused in (dict(fp8=("rowwise",)), dict(fp8=("tensorwise",), dp_mode="replicate"), dict(fp8=(None,))):
        assert not any(c.fp8_all_gather for c in top(**refused)), refused
