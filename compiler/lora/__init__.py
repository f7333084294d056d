"""LoRA (Hu et al. 2021): its config and targets (config.py), the adapted modules and their initial values
(modules.py), and merging adapters into weights (merge.py). The parallelizer applies it: compiler/parallelize/lora.py."""

from compiler.lora.config import BASE_DTYPES, EXPERTS, LoraConfig, default_targets, target_kind, target_problem, valid_targets
from compiler.lora.merge import merged_weights
from compiler.lora.modules import LoraExperts, LoraLinear, adapter_initial_value, base_of, is_adapter

__all__ = ["BASE_DTYPES", "EXPERTS", "LoraConfig", "LoraExperts", "LoraLinear", "adapter_initial_value", "base_of",
           "default_targets", "is_adapter", "merged_weights", "target_kind", "target_problem", "valid_targets"]
