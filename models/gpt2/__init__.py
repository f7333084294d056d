"""The GPT-2 family (Radford et al. 2019): learned positions, LayerNorm, GELU MLP, biases, tied embeddings."""

from models.gpt2 import hf, model, tp_plan
from models.spec import Architecture, HFAdapter, ModelSpec

SPEC = ModelSpec(
    family="gpt2",
    description="GPT-2: tiny (tests), small (124M), medium (355M), large (774M)",
    config_type=model.GPTConfig,
    sizes=model.MODEL_SIZES,
    debug_size="tiny",
    build=model.build,
    initial_value=model.initial_value,
    with_overrides=model.with_overrides,
    check=model.check,
    flops_per_token=model.flops_per_token,
    block_tp_plan=tp_plan.BLOCK_TP_PLAN,
    sequence_parallel_plan=tp_plan.SEQUENCE_PARALLEL_PLAN,
    architecture=Architecture(mlp="gelu", norm="layernorm", positions="learned", biases=True, fused_qkv=True),
    hf=HFAdapter(architectures=("GPT2LMHeadModel",), model_types=("gpt2",), config_to_hf=hf.config_to_hf,
                 config_from_hf=hf.config_from_hf, to_hf=hf.to_hf, from_hf=hf.from_hf),
)
