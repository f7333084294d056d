"""The gpt-oss family (OpenAI 2025): grouped-query attention with biases, attention sinks and a sliding window on
every other layer, YaRN, and in every block a mixture of clamped-SwiGLU experts with biases behind a biased router."""

from models.common import tp_plan
from models.gpt_oss import config, hf, model
from models.spec import Architecture, HFAdapter, ModelSpec

SPEC = ModelSpec(
    family="gpt_oss",
    description="gpt-oss: gpt-oss-debug (tests), gpt-oss-20b, gpt-oss-120b",
    config_type=config.GptOssConfig,
    sizes=config.MODEL_SIZES,
    debug_size="gpt-oss-debug",
    build=model.build,
    initial_value=model.initial_value,
    with_overrides=config.with_overrides,
    check=config.check,
    flops_per_token=config.flops_per_token,
    block_tp_plan=tp_plan.SINK_BLOCK_TP_PLAN,
    sequence_parallel_plan=tp_plan.DENSE_SEQUENCE_PARALLEL_PLAN,
    architecture=Architecture(mlp="swiglu", norm="rmsnorm", positions="rope", biases=True, fused_qkv=False,
                              sinks=True),
    hf=HFAdapter(architectures=(hf.ARCHITECTURE,), model_types=(hf.MODEL_TYPE,), config_to_hf=hf.config_to_hf,
                 config_from_hf=hf.config_from_hf, to_hf=hf.to_hf, from_hf=hf.from_hf, row_wise=hf.is_row_wise,
                 quantized={"mxfp4": (hf.QUANTIZED, hf.NOT_QUANTIZED)}),
    config_from_dict=config.config_from_dict,
    block_kinds=config.block_kinds,
    experts=config.experts,
    attention_windows=config.attention_windows,
)
