"""The Qwen3-MoE family (Yang et al. 2025): Qwen3's attention and a softmax top-k mixture of experts in every
block (blocks listed by ``mlp_only_layers`` / skipped by ``decoder_sparse_step`` stay dense)."""

from models.common import hf_layout, tp_plan
from models.qwen3_moe import config, hf, model
from models.spec import Architecture, HFAdapter, ModelSpec

SPEC = ModelSpec(
    family="qwen3_moe",
    description="Qwen3-MoE: qwen3-moe-debug (tests), qwen3-30b-a3b, qwen3-235b-a22b",
    config_type=config.Qwen3MoeConfig,
    sizes=config.MODEL_SIZES,
    debug_size="qwen3-moe-debug",
    build=model.build,
    initial_value=model.initial_value,
    with_overrides=config.with_overrides,
    check=config.check,
    flops_per_token=config.flops_per_token,
    block_tp_plan=tp_plan.QK_NORM_BLOCK_TP_PLAN,
    sequence_parallel_plan=tp_plan.DENSE_SEQUENCE_PARALLEL_PLAN,
    architecture=Architecture(mlp="swiglu", norm="rmsnorm", positions="rope", biases=False, fused_qkv=False,
                              qk_norm=True),
    hf=HFAdapter(architectures=(hf.ARCHITECTURE,), model_types=(hf.MODEL_TYPE,), config_to_hf=hf.config_to_hf,
                 config_from_hf=hf.config_from_hf, to_hf=hf.to_hf, from_hf=hf.from_hf,
                 stacked=hf_layout.is_stacked),
    config_from_dict=config.config_from_dict,
    block_kinds=config.block_kinds,
    experts=config.experts,
)
