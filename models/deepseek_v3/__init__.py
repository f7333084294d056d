"""The DeepSeek-V3 family (DeepSeek-AI 2024): multi-head latent attention with YaRN, and a mixture of experts with
DeepSeek-V3's router (sigmoid, group-limited top-k, selection-only bias) and shared experts after the first dense
blocks."""

from models.common import hf_layout, tp_plan
from models.deepseek_v3 import config, hf, model
from models.spec import Architecture, HFAdapter, ModelSpec

SPEC = ModelSpec(
    family="deepseek_v3",
    description="DeepSeek-V3: deepseek-v3-debug, deepseek-v3-16b-debug (tests), deepseek-v3-16b (DeepSeek-V2-Lite's "
                "shape), deepseek-v3",
    config_type=config.DeepseekV3Config,
    sizes=config.MODEL_SIZES,
    debug_size="deepseek-v3-debug",
    build=model.build,
    initial_value=model.initial_value,
    with_overrides=config.with_overrides,
    check=config.check,
    flops_per_token=config.flops_per_token,
    block_tp_plan=tp_plan.LATENT_BLOCK_TP_PLAN,
    sequence_parallel_plan=tp_plan.LATENT_SEQUENCE_PARALLEL_PLAN,
    architecture=Architecture(mlp="swiglu", norm="rmsnorm", positions="rope", biases=False, fused_qkv=False),
    hf=HFAdapter(architectures=(hf.ARCHITECTURE,), model_types=(hf.MODEL_TYPE,), config_to_hf=hf.config_to_hf,
                 config_from_hf=hf.config_from_hf, to_hf=hf.to_hf, from_hf=hf.from_hf,
                 stacked=hf_layout.is_stacked, quantized={"fp8-blocks": (hf.FP8_QUANTIZED, None)}),
    config_from_dict=config.config_from_dict,
    block_kinds=config.block_kinds,
    experts=config.experts,
    latent_attention=config.latent_attention,
)
