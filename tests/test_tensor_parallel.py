"""A tensor-parallel (mp=2) stage computes what its dense twin computes, forward and backward."""

from __future__ import annotations

import datetime

import pytest
import torch

from tests.launch import spawn_ranks

pytestmark = pytest.mark.slow  # real multi-process jobs


def _compare_tp_stage_with_dense(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from compiler.parallelize.tensor_parallel import apply_tp, restore_linear_modules
    from compiler.trace import trace_pipeline
    from models.gpt import MODEL_SIZES, build_gpt
    from models.tp_plan import GPT_BLOCK_TP_PLAN
    from runtime.distributed.mesh import GridLayout, build_mesh

    dist.init_process_group("gloo")
    mesh = build_mesh("cpu", GridLayout(1, 1, 2), timeout=datetime.timedelta(seconds=120))
    cfg = MODEL_SIZES["tiny"]
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    stages = []
    for _ in range(2):  # two identical traces: one gets sharded, one stays dense
        model = build_gpt(cfg, seed=5)
        stage = trace_pipeline(model, example_microbatch=tokens, blocks_per_stage=[2, 2]).get_stage_module(0)
        restore_linear_modules(stage, model)
        stages.append(stage)
    tp, dense = stages
    apply_tp(tp, mesh["mp"], block_plan=GPT_BLOCK_TP_PLAN)
    qkv = tp.get_submodule("layers.0.attn.qkv").weight
    assert isinstance(qkv, DTensor) and qkv.to_local().shape == (3 * cfg.d_model // 2, cfg.d_model)

    out_tp, out_dense = tp(tokens), dense(tokens)
    torch.testing.assert_close(out_tp, out_dense, rtol=1e-5, atol=1e-6)
    torch.manual_seed(1)  # same upstream gradient on both ranks
    upstream = torch.randn_like(out_dense)
    (out_tp * upstream).sum().backward()
    (out_dense * upstream).sum().backward()
    dense_grads = dict(dense.named_parameters())
    for name, p in tp.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, dense_grads[name].grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    open(f"{out_dir}/ok{dist.get_rank()}", "w").close()
    dist.destroy_process_group()


def test_tp_stage_equals_dense_twin(tmp_path):
    spawn_ranks(_compare_tp_stage_with_dense, world_size=2, args=(str(tmp_path),), timeout=120)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
