"""The Mixtral family (Jiang et al. 2024): Llama's attention and a mixture of 8 SwiGLU experts, 2 per token, in
every block."""

from models.common import hf_layout, tp_plan
from models.mixtral import config, hf, model
from models.spec import Architecture, HFAdapter, ModelSpec

SPEC = ModelSpec(
    family="mixtral",
    description="Mixtral: mixtral-debug (tests), mixtral-8x7b, mixtral-8x22b",
    config_type=config.MixtralConfig,
    sizes=config.MODEL_SIZES,
    debug_size="mixtral-debug",
    build=model.build,
    initial_value=model.initial_value,
    with_overrides=config.with_overrides,
    check=config.check,
    flops_per_token=config.flops_per_token,
    block_tp_plan=tp_plan.DENSE_BLOCK_TP_PLAN,
    sequence_parallel_plan=tp_plan.DENSE_SEQUENCE_PARALLEL_PLAN,
    architecture=Architecture(mlp="swiglu", norm="rmsnorm", positions="rope", biases=False, fused_qkv=False),
    hf=HFAdapter(architectures=(hf.ARCHITECTURE,), model_types=(hf.MODEL_TYPE,), config_to_hf=hf.config_to_hf,
                 config_from_hf=hf.config_from_hf, to_hf=hf.to_hf, from_hf=hf.from_hf,
                 stacked=hf_layout.is_stacked),
    block_kinds=config.block_kinds,
    experts=config.experts,
)
