"""LoRA applied to a model: the targets wrapped under their own names, everything else frozen (optionally stored in
bf16), and the rule that shards each adapter with its base under tensor parallelism (the sharded runs themselves:
tests/launches/test_parity.py and tests/launches/test_lora.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from compiler.lora import LoraConfig, LoraExperts, LoraLinear
from compiler.parallelize.lora import adapter_placements, apply_lora, lora_parameter_shapes
from models import build_model, named_config, parameter_shapes, spec_of

LLAMA = named_config("llama3-debug", n_layers=2)


def _meta(cfg) -> nn.Module:
    with torch.device("meta"):
        return spec_of(cfg).build(cfg)


def test_targets_are_wrapped_in_place_and_only_adapters_train():
    model = _meta(LLAMA)
    names = apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "down")))
    assert names == ["layers.0.attn.q", "layers.0.attn.v", "layers.0.mlp.down", "layers.1.attn.q", "layers.1.attn.v",
                     "layers.1.mlp.down"]
    assert isinstance(model.layers["0"].attn.q, LoraLinear) and type(model.layers["0"].attn.k) is nn.Linear
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {f"{m}.lora_{ab}.weight" for m in names for ab in "AB"}
    assert model.layers["1"].attn.q.lora_B.weight.shape == (LLAMA.n_heads * LLAMA.head_dim, 4)


def test_the_experts_get_one_adapter_each_and_the_router_none():
    cfg = named_config("qwen3-moe-debug", n_layers=2)
    model = _meta(cfg)
    apply_lora(model, LoraConfig(rank=2, alpha=2.0, targets=("experts",)))
    experts = model.layers["0"].moe.experts
    assert isinstance(experts, LoraExperts) and type(model.layers["0"].moe.router.gate) is nn.Linear
    assert experts.w1_lora_A.shape == (cfg.n_experts, 2, cfg.d_model)


def test_a_bf16_base_stores_the_frozen_matrices_in_bf16_and_keeps_a_tied_weight_one():
    model = build_model(named_config("tiny", n_layers=1), seed=0)  # GPT-2: the head is the embedding
    apply_lora(model, LoraConfig(rank=2, alpha=2.0, targets=("qkv",), base_dtype="bf16"))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["tok_emb.weight"] == dtypes["layers.0.attn.qkv.weight"] == torch.bfloat16
    assert dtypes["layers.0.ln1.weight"] == dtypes["layers.0.attn.qkv.lora_A.weight"] == torch.float32
    assert model.head.weight is model.tok_emb.weight


def test_a_checkpoint_of_a_lora_run_holds_the_base_and_the_adapters():
    lora = LoraConfig(rank=4, alpha=8.0, targets=("o",))
    shapes = lora_parameter_shapes(LLAMA, lora)
    assert {n: s for n, s in shapes.items() if "lora" not in n} == parameter_shapes(LLAMA)
    assert shapes["layers.1.attn.o.lora_A.weight"] == (4, LLAMA.n_heads * LLAMA.head_dim)
    assert lora_parameter_shapes(LLAMA, None) == parameter_shapes(LLAMA)


def test_adapters_are_split_where_their_products_stay_local():
    # column-parallel: A whole, B by output rows; row-parallel: A by input columns, B whole; replicated: both whole
    for base, a, b in ((Shard(0), Replicate(), Shard(0)), (Shard(1), Shard(1), Replicate()),
                       (Replicate(), Replicate(), Replicate())):
        assert adapter_placements(base) == ([a], [b])
