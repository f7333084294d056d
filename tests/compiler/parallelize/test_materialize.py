"""Materialising a stage: each parameter gets exactly its shard, and only the shard leaves the host."""

from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode

from compiler.parallelize.data_parallel import DataParallelOptions
from compiler.parallelize.stages import StageMeshes, build_local_stages
from models import named_config, spec_of
from tests.fake_world import fake_world


class _RecordTransfers(TorchFunctionMode):
    """Elements of every tensor that ``Tensor.to`` converts or ``copy_`` reads from."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            self.sizes.append(args[0].numel())
        elif func is torch.Tensor.copy_:
            self.sizes.append(args[1].numel())
        return func(*args, **kwargs)


def test_only_each_shard_is_copied_to_the_device_and_it_is_the_right_one():
    """Rank 3 of a 2x1x2 mesh (dp 1, mp 1): FSDP over a TP shard. The values are this rank's rows and columns
    of the full name-seeded tensors; nothing larger than a parameter's local shard is converted or copied."""
    cfg = named_config("tiny")
    values = functools.partial(spec_of(cfg).initial_value, seed=0, cfg=cfg)
    recorder = _RecordTransfers()
    with fake_world(rank=3, world_size=4):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "pp", "mp"))
        import compiler.parallelize.stages as stages_module

        real = stages_module.materialize

        def recorded(*args, **kwargs):
            with recorder:
                return real(*args, **kwargs)

        stages_module.materialize = recorded
        try:
            stages = build_local_stages(
                cfg, blocks_per_stage=[cfg.n_layers], stage_indices=[0], micro_batch_size=2,
                meshes=StageMeshes(pp=mesh["pp"], mp=mesh["mp"], fsdp=mesh["dp"]), device=torch.device("cpu"),
                activation_checkpointing="none", data_parallel=DataParallelOptions(), initial_value=values)
        finally:
            stages_module.materialize = real
        params = dict(stages.named_parameters())
        local = {name: p.to_local() for name, p in params.items()}

    d = cfg.d_model
    qkv = values("layers.0.attn.qkv.weight", (3 * d, d))  # column-parallel: mp rank 1 holds rows 3d/2..3d,
    torch.testing.assert_close(local["layers.0.attn.qkv.weight"], qkv[3 * d // 2:][3 * d // 4:], rtol=0, atol=0)
    o = values("layers.0.attn.o.weight", (d, d))  # row-parallel: mp rank 1 holds columns d/2..d; FSDP rows
    torch.testing.assert_close(local["layers.0.attn.o.weight"], o[d // 2:, d // 2:], rtol=0, atol=0)
    ln = values("layers.0.ln1.weight", (d,))  # replicated over mp, FSDP-sharded over dp
    torch.testing.assert_close(local["layers.0.ln1.weight"], ln[d // 2:], rtol=0, atol=0)

    largest_shard = max(t.numel() for t in local.values())
    largest_full = max(p.numel() for p in params.values())
    assert recorder.sizes, "materialize copied nothing"
    assert largest_shard < largest_full
    assert max(recorder.sizes) <= largest_shard, (
        f"a tensor of {max(recorder.sizes)} elements was moved; the largest shard holds {largest_shard}")
