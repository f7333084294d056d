from models.gpt import GPT, MODEL_SIZES, GPTConfig, build_gpt, init_weights, initial_value
from models.tp_plan import GPT_BLOCK_TP_PLAN

__all__ = ["GPT", "GPTConfig", "MODEL_SIZES", "build_gpt", "init_weights", "initial_value", "GPT_BLOCK_TP_PLAN"]
