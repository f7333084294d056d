"""The tensor-parallel plan is data next to the model: every key names a real nn.Linear of a block."""

from torch import nn

from models.gpt import GPT, MODEL_SIZES, Block
from models.tp_plan import COLWISE, GPT_BLOCK_TP_PLAN, ROWWISE


def test_every_plan_key_matches_a_linear_in_every_block():
    model = GPT(MODEL_SIZES["tiny"])
    for block_name, block in model.layers.named_children():
        assert isinstance(block, Block)
        for key in GPT_BLOCK_TP_PLAN:
            assert isinstance(block.get_submodule(key), nn.Linear), f"layers.{block_name}.{key}"


def test_plan_is_the_megatron_layout():
    colwise = {k for k, v in GPT_BLOCK_TP_PLAN.items() if v == COLWISE}
    rowwise = {k for k, v in GPT_BLOCK_TP_PLAN.items() if v == ROWWISE}
    assert colwise == {"attn.qkv", "mlp.up"}
    assert rowwise == {"attn.o", "mlp.down"}
