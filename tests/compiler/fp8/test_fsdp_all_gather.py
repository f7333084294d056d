"""FSDP2 all-gathering FP8 weights (compiler/fp8/fsdp_all_gather.py, wired by compiler/parallelize/float8.py) on two
gloo ranks: the outputs and weight gradients equal one process's tensorwise FP8 linear on the whole weights bit for
bit, the gathered weight is e4m3 bytes (half of a bf16 gather's), the step's one scale survives ZeRO-3's re-gathers
and is recomputed after the weights change, and checkpoints see the fp32 master shard."""

from __future__ import annotations

import datetime

import pytest
import torch
from torch import nn

from compiler.fp8 import RECIPES, swap_linears
from tests.launch import spawn_ranks

D_IN, D_HID = 16, 24  # both linears' rows split evenly over 2 ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    # block 0: a norm (fp32 bytes) and a linear in one FSDP unit (mixed dtypes: FSDP gathers uint8); block 1: a
    # linear alone (the unit all-gathers float8 itself)
    return nn.Sequential(nn.Sequential(nn.LayerNorm(D_IN), nn.Linear(D_IN, D_HID)), nn.Sequential(nn.Linear(D_HID, D_IN)))


def _gathered_bytes_counter(dist):
    """Wrap the collective FSDP2 all-gathers with (all_gather_single on 2.13, all_gather_into_tensor before) to
    sum the bytes of its outputs."""
    counted = [0]
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            original = getattr(dist, name)

            def counting(output, *args, _original=original, **kwargs):
                counted[0] += output.numel() * output.element_size()
                return _original(output, *args, **kwargs)

            setattr(dist, name, counting)
    return counted


def _fsdp_fp8_gather_matches_one_process() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from compiler.fp8.fsdp_all_gather import GatheredFp8Weight
    from compiler.parallelize.float8 import Fp8AllGatherAmaxes, Fp8Options, master_weight, maybe_apply_fp8_all_gather

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    recipe = RECIPES["tensorwise"]
    x = torch.randn(6, D_IN, generator=torch.Generator().manual_seed(1))  # the same batch on both ranks

    one = swap_linears(_model(), recipe)
    want = one(x)
    want.square().sum().backward()

    def sharded(all_gather: bool, *, zero3: bool = False, param_dtype=None) -> nn.Module:
        model = swap_linears(_model(), recipe)
        maybe_apply_fp8_all_gather(model, Fp8Options(recipe, all_gather=all_gather))
        policy = MixedPrecisionPolicy(param_dtype=param_dtype)
        for block in model:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=zero3)
        return fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=zero3)

    model = sharded(True, zero3=True)
    seen = []
    for linear in (model[0][1], model[1][0]):
        linear.register_forward_pre_hook(lambda m, _args: seen.append(m.weight))
    amaxes = Fp8AllGatherAmaxes([model])
    amaxes.before_step()
    got = model(x)
    got.square().sum().backward()  # ZeRO-3: the backward gathers again, with the cached scale
    assert all(isinstance(w, GatheredFp8Weight) and w.data_fp8.dtype == torch.float8_e4m3fn for w in seen), seen
    assert torch.equal(got, want), f"rank {rank}: output {(got - want).abs().max()}"
    for (name, p), (_, q) in zip(model.named_parameters(), one.named_parameters()):
        shard = q.grad.chunk(2)[rank]  # FSDP's dim-0 chunks; both ranks' gradients equal, so their mean is either
        assert torch.equal(p.grad.to_local(), shard), f"rank {rank}: d{name} {(p.grad.to_local() - shard).abs().max()}"
        assert type(master_weight(p.detach()).to_local()) is torch.Tensor, f"{name} would checkpoint a subclass"

    # The weights change (an optimizer step): the next gather's scale is the new whole weight's, bit for bit, both
    # reduced inside the gather (a validation's forward) and precomputed (the next step).
    for precompute in (False, True):
        amaxes.after_step()
        with torch.no_grad():
            for p, q in zip(model.parameters(), one.parameters()):
                p.mul_(3.0)
                q.mul_(3.0)
        if precompute:
            amaxes.before_step()
        assert torch.equal(model(x), one(x)), f"rank {rank}: stale scale after the weights changed"

    # Bytes: the linears' weights cross in e4m3, half of a bf16 gather's (the norm is the same in both runs).
    totals = {}
    for all_gather in (False, True):
        model = sharded(all_gather, param_dtype=torch.bfloat16)
        counted = _gathered_bytes_counter(dist)
        Fp8AllGatherAmaxes([model]).before_step()
        model(x)
        totals[all_gather] = counted[0]
    others = (2 * D_IN + D_HID + D_IN) * 2  # the norm's weight and bias, the linears' biases: bf16 (gathered whole)
    weights = 2 * D_IN * D_HID  # the two linears' weights' elements
    assert totals[False] == others + 2 * weights, totals
    assert totals[True] == others + weights, totals
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_gathers_fp8_weights_that_compute_as_one_process():
    spawn_ranks(_fsdp_fp8_gather_matches_one_process, world_size=2, timeout=120)
