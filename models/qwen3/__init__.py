"""The Qwen3 dense family (Yang et al. 2025): Llama's decoder with a head_dim of its own and per-head q/k
RMSNorms before RoPE; embeddings tied in 0.6B, 1.7B and 4B."""

from models.common import tp_plan
from models.qwen3 import config, hf, model
from models.spec import Architecture, HFAdapter, ModelSpec

SPEC = ModelSpec(
    family="qwen3",
    description="Qwen3 dense: qwen3-debug (tests), qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b, qwen3-32b",
    config_type=config.Qwen3Config,
    sizes=config.MODEL_SIZES,
    debug_size="qwen3-debug",
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
                 config_from_hf=hf.config_from_hf, to_hf=hf.to_hf, from_hf=hf.from_hf),
)
