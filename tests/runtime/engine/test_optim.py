import math

import pytest
import torch

from runtime.engine.optim import build_optimizer, lr_multiplier


def test_warmup_then_cosine_to_a_tenth():
    mult = [lr_multiplier(s, warmup_steps=10, total_steps=110) for s in range(110)]
    assert mult[0] == pytest.approx(0.1) and mult[9] == pytest.approx(1.0)
    assert mult[10] == pytest.approx(1.0)
    assert mult[60] == pytest.approx(0.55)  # half-way through the decay
    assert all(a >= b for a, b in zip(mult[10:], mult[11:]))
    assert lr_multiplier(110, warmup_steps=10, total_steps=110) == pytest.approx(0.1)
    assert lr_multiplier(0, warmup_steps=0, total_steps=10) == pytest.approx(1.0)


def test_weight_decay_only_on_matrices():
    w, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    opt = build_optimizer([w, b], lr=1.0, weight_decay=0.5)
    decays = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decays == {id(w): 0.5, id(b): 0.0}
    assert not math.isnan(opt.defaults["lr"])


def test_devices_without_a_fused_kernel_take_the_foreach_kernels():
    params = [torch.nn.Parameter(torch.ones(2, 2, device="meta")), torch.nn.Parameter(torch.ones(2, device="meta"))]
    opt = build_optimizer(params, lr=0.1, weight_decay=0.5)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


@pytest.fixture
def one_rank_meshes():
    """A one-process gloo world and a (dp, mp) = (1, 1) mesh: DTensors on 1-D and 2-D meshes, in this process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "mp"))
    finally:
        dist.destroy_process_group()


def test_multi_tensor_adamw_over_plain_and_dtensor_parameters(one_rank_meshes):
    """A TP stage's mix (plain norms, DTensor weights on the mp mesh and, under FSDP, on the (dp, mp) and dp
    meshes) takes the fused kernels (CPU has them, as CUDA does), each group of one kind, and updates exactly
    like the per-parameter loop (foreach=False)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = one_rank_meshes
    torch.manual_seed(0)
    values = [torch.randn(4, 3), torch.randn(3), torch.randn(5, 3), torch.randn(5), torch.randn(2, 2)]
    layouts = [(mesh["mp"], [Shard(0)]), None, (mesh, [Shard(0), Shard(1)]), (mesh, [Shard(0), Replicate()]),
               (mesh["dp"], [Shard(0)])]

    def parameters() -> list[torch.nn.Parameter]:
        params = []
        for value, layout in zip(values, layouts):
            p = torch.nn.Parameter(value.clone() if layout is None else distribute_tensor(value.clone(), *layout))
            p.grad = torch.ones_like(p) * 0.5 if layout is None else distribute_tensor(torch.full(value.shape, 0.5), *layout)
            params.append(p)
        return params

    multi, loop = parameters(), parameters()
    opt = build_optimizer(multi, lr=0.1, weight_decay=0.5)
    assert opt.defaults["fused"] is True
    for group in opt.param_groups:
        kinds = {(type(p), p.device_mesh if isinstance(p, DTensor) else None) for p in group["params"]}
        assert len(kinds) == 1, f"a group mixes {kinds}"
        assert group["weight_decay"] == (0.5 if group["params"][0].ndim >= 2 else 0.0)
    assert sorted(id(p) for g in opt.param_groups for p in g["params"]) == sorted(id(p) for p in multi)
    reference = torch.optim.AdamW([{"params": [p for p in loop if p.ndim >= 2], "weight_decay": 0.5},
                                   {"params": [p for p in loop if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=0.1, betas=(0.9, 0.95), foreach=False)
    for _ in range(2):
        opt.step()
        reference.step()
    for got, want in zip(multi, loop):
        full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
        torch.testing.assert_close(full(got.detach()), full(want.detach()), rtol=1e-6, atol=1e-7)


def test_fused_adamw_steps_under_the_fp16_scaler_and_skips_on_inf(one_rank_meshes):
    """On CUDA the engine's AdamW is fused, and fused optimizers take the scaler's found-inf flag into their
    kernel (pytorch issue 140514: a [1]-shaped flag failed against the 0-d step counts). CPU has a fused
    AdamW too: unscale, step and skip exactly like the per-parameter loop under the same scaler."""
    from runtime.engine.amp import build_grad_scaler

    def run(fused: bool, inf_at: int) -> list[float]:
        p = torch.nn.Parameter(torch.arange(4.0))
        opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.95), fused=fused, foreach=False if not fused else None)
        scaler = build_grad_scaler("fp16", "cpu")
        scales = []
        for step in range(3):
            opt.zero_grad()
            scaler.scale((p * p).sum() * (float("inf") if step == inf_at else 1.0)).backward()
            scaler.unscale_(opt)  # as the engine does, for clipping
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return [*p.detach().tolist(), *scales]

    fused, loop = run(True, inf_at=1), run(False, inf_at=1)
    assert fused == pytest.approx(loop, rel=1e-6)
    assert fused[-2] == fused[-3] / 2  # the inf step halved the scale (and was skipped)
    assert run(True, inf_at=99)[:4] != pytest.approx(fused[:4])  # the skip changed the parameters
