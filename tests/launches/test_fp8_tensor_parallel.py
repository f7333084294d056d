"""compiler/fp8/tensor_parallel.py on 2 real ranks: a ``Float8Linear`` made column-parallel, row-parallel (with
biases) or replicated by DTensor's styles computes the one-process FP8 linear's output, input gradient and weight
and bias gradients (the same FP8 bytes and scales; products of another width may round differently in the
last bit), and with each shard's own scales (the amax reduction left out) tensorwise's do not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launch import spawn_ranks

pytestmark = pytest.mark.slow  # a real 2-rank job

STYLES = ("colwise", "rowwise", "replicated")


def _compare_on_two_ranks(out_path: str) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import compiler.fp8.tensor_parallel as tensor_parallel
    from compiler.fp8 import RECIPES, fp8_linear, swap_linears
    from compiler.parallelize.replicated_modules import ReplicatedLinear

    dist.init_process_group("gloo")
    rank, mesh = dist.get_rank(), init_device_mesh("cpu", (2,))
    reduce_over = tensor_parallel.max_over
    errors = {}
    for name, recipe in RECIPES.items():
        for style in STYLES:
            for per_shard in (False, True):
                tensor_parallel.max_over = (lambda group: lambda a: a) if per_shard else reduce_over
                g = torch.Generator().manual_seed(0)
                linear = nn.Linear(256, 512)
                with torch.no_grad():  # columns and rows of different magnitudes: each shard its own amax
                    linear.weight.copy_(torch.randn(512, 256, generator=g) * torch.linspace(0.2, 2, 256))
                    linear.bias.copy_(torch.randn(512, generator=g))
                x = torch.randn(4, 8, 256, generator=g) * torch.linspace(3, 0.1, 256)
                dy = torch.randn(4, 8, 512, generator=g) * torch.linspace(0.1, 2, 512)
                whole = [t.detach().clone().requires_grad_() for t in (x, linear.weight, linear.bias)]
                y = fp8_linear(whole[0], whole[1], whole[2], recipe)
                y.backward(dy)
                model = swap_linears(nn.Sequential(linear), recipe)
                plan = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(), "replicated": ReplicatedLinear()}
                parallelize_module(model, mesh, {"0": plan[style]})
                mine = (x.chunk(2, -1)[rank] if style == "rowwise" else x).clone().requires_grad_()
                out = model(mine)
                out.backward(dy.chunk(2, -1)[rank] if style == "colwise" else dy)
                pairs = [(out, y.chunk(2, -1)[rank] if style == "colwise" else y),
                         (mine.grad, whole[0].grad.chunk(2, -1)[rank] if style == "rowwise" else whole[0].grad),
                         (model[0].weight.grad.full_tensor(), whole[1].grad),
                         (model[0].bias.grad.full_tensor(), whole[2].grad)]
                errors[f"{name} {style} {'per-shard' if per_shard else 'whole'}"] = max(
                    float((a - b).abs().max()) / float(b.abs().max()) for a, b in pairs)
    if rank == 0:
        Path(out_path).write_text(json.dumps(errors))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> dict[str, float]:
    out = tmp_path_factory.mktemp("fp8_tp") / "errors.json"
    spawn_ranks(_compare_on_two_ranks, world_size=2, args=(str(out),), timeout=240)
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("style", STYLES)
def test_a_tensor_parallel_fp8_linear_is_the_one_process_linear(errors, name, style):
    # fp32 sums of the same FP8 products over another split of K: a few ulps of the largest entry
    assert errors[f"{name} {style} whole"] < 1e-5, errors


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_per_shard_tensorwise_scales_are_another_linear(errors, style):
    # one e4m3 / e5m2 step of re-rounding on the shard whose amax is not the whole's: percents, not ulps
    assert errors[f"tensorwise {style} per-shard"] > 1e-3, errors
