"""A tensor-parallel (mp=2) stage computes what its dense twin computes, forward and backward; the
vocabulary-parallel cross-entropy equals the whole vocabulary's."""

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
    from models import build_model, named_config, spec_of
    from runtime.distributed.mesh import GridLayout, build_mesh

    dist.init_process_group("gloo")
    mesh = build_mesh("cpu", GridLayout(1, 1, 2), timeout=datetime.timedelta(seconds=120))
    cfg = named_config("tiny")
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    stages = []
    for _ in range(2):  # two identical traces: one gets sharded, one stays dense
        model = build_model(cfg, seed=5)
        stage = trace_pipeline(model, example_microbatch=tokens, blocks_per_stage=[2, 2]).get_stage_module(0)
        restore_linear_modules(stage, model)
        stages.append(stage)
    tp, dense = stages
    apply_tp(tp, mesh["mp"], block_plan=spec_of(cfg).block_tp_plan)
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
    _check_head_logits_are_only_read(mesh, cfg, tokens)
    _check_vocabulary_parallel_cross_entropy(mesh)
    open(f"{out_dir}/ok{dist.get_rank()}", "w").close()
    dist.destroy_process_group()


def _check_head_logits_are_only_read(mesh, cfg, tokens) -> None:
    """The vocabulary-parallel head's logits are a view (DTensor's ``to_local``): FSDP's view warning is about
    them. Neither loss function writes them in place, so FSDP's pre-backward hook on them cannot be lost."""
    from compiler.parallelize.tensor_parallel import apply_tp, restore_linear_modules
    from compiler.trace import trace_pipeline
    from models import build_model, spec_of
    from runtime.engine.amp import build_grad_scaler, scaled_cross_entropy
    from runtime.engine.evaluation import summed_cross_entropy

    model = build_model(cfg, seed=5)
    head_stage = trace_pipeline(model, example_microbatch=tokens, blocks_per_stage=[2, 2]).get_stage_module(1)
    restore_linear_modules(head_stage, model)
    apply_tp(head_stage, mesh["mp"], block_plan=spec_of(cfg).block_tp_plan, model_plan=spec_of(cfg).model_tp_plan)
    hidden = torch.randn(2, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(2), requires_grad=True)
    targets = tokens.roll(-1, dims=1)
    loss_fns = [scaled_cross_entropy(build_grad_scaler("fp32", "cpu"), microbatches=1, vocab_mesh=mesh["mp"],
                                     vocab_size=cfg.vocab_size),
                summed_cross_entropy(vocab_mesh=mesh["mp"], vocab_size=cfg.vocab_size)]
    for loss_fn in loss_fns:
        logits = head_stage(hidden)  # (B, T, V / mp) on this rank
        assert logits._base is not None, "the head's logits are no longer a view: the warning filter can go"
        version, base_version = logits._version, logits._base._version
        loss = loss_fn(logits, targets)
        loss.backward()
        assert (logits._version, logits._base._version) == (version, base_version), "the loss wrote the logits"
        assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
        hidden.grad = None


def _check_vocabulary_parallel_cross_entropy(mesh) -> None:
    """The chunked loss on this rank's columns of an odd vocabulary (11 = 6 + 5, as DTensor shards the head)
    equals F.cross_entropy on the whole logits: the value on every rank, and this rank's columns of the gradient."""
    import torch.nn.functional as F

    from compiler.parallelize.cross_entropy import IGNORE_INDEX, chunked_cross_entropy, vocabulary_shard

    vocab, rows = 11, 20
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(rows, vocab, generator=g)  # [N, V], the same on both ranks
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[::4] = IGNORE_INDEX
    shard = vocabulary_shard(mesh["mp"], vocab)
    width = -(-vocab // 2) if shard.start == 0 else vocab - -(-vocab // 2)
    for reduction in ("mean", "sum"):
        whole = logits.clone().requires_grad_()
        want = F.cross_entropy(whole, targets, reduction=reduction)
        want.backward()
        mine = logits[:, shard.start:shard.start + width].clone().requires_grad_()  # [N, V_r]
        got = chunked_cross_entropy(mine, targets, reduction=reduction, group=shard.group, vocab_start=shard.start,
                                    rows_per_chunk=3)
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        torch.testing.assert_close(mine.grad, whole.grad[:, shard.start:shard.start + width], rtol=1e-5, atol=1e-7)


def test_tp_stage_equals_dense_twin(tmp_path):
    spawn_ranks(_compare_tp_stage_with_dense, world_size=2, args=(str(tmp_path),), timeout=120)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def test_only_fsdps_view_warning_about_our_stages_is_silenced():
    import warnings

    from compiler.parallelize.tensor_parallel import quiet_head_view_warning

    message = ("FSDP2-wrapped module (FSDPGraphModule) returned a view tensor. An in-place op on this view (e.g., "
               "`x += y`) will silently drop the pre-backward hook and skip the all-gather, which can cause backward "
               "to fail or produce wrong gradients.")
    cases = [(message, "torch.distributed.fsdp._fully_shard._fsdp_state", False),  # the one we explain
             (message, "somewhere.else", True),  # the same words from other code
             (message.replace("FSDPGraphModule", "Linear"), "torch.distributed.fsdp._fully_shard._fsdp_state", True)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_head_view_warning()
        for text, module, _ in cases:
            warnings.warn_explicit(text, UserWarning, filename="x.py", lineno=1, module=module)
    assert [str(w.message) for w in caught] == [text for text, _, shown in cases if shown]
