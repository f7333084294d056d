"""The Llama 3 family (Dubey et al. 2024): RMSNorm, grouped-query attention, RoPE with Llama 3's frequency
scaling, SwiGLU MLP, no biases; embeddings tied in the 1B and 3B sizes."""

from models.common import tp_plan
from models.llama3 import config, hf, model
from models.spec import Architecture, HFAdapter, ModelSpec

SPEC = ModelSpec(
    family="llama3",
    description="Llama 3: llama3-debug (tests), llama3-1b, llama3-3b (Llama 3.2), llama3-8b, llama3-70b, "
                "llama3-405b (Llama 3.1)",
    config_type=config.LlamaConfig,
    sizes=config.MODEL_SIZES,
    debug_size="llama3-debug",
    build=model.build,
    initial_value=model.initial_value,
    with_overrides=config.with_overrides,
    check=config.check,
    flops_per_token=config.flops_per_token,
    block_tp_plan=tp_plan.DENSE_BLOCK_TP_PLAN,
    sequence_parallel_plan=tp_plan.DENSE_SEQUENCE_PARALLEL_PLAN,
    architecture=Architecture(mlp="swiglu", norm="rmsnorm", positions="rope", biases=False, fused_qkv=False),
    hf=HFAdapter(architectures=("LlamaForCausalLM",), model_types=("llama",), config_to_hf=hf.config_to_hf,
                 config_from_hf=hf.config_from_hf, to_hf=hf.to_hf, from_hf=hf.from_hf),
)
