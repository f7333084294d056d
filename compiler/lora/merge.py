"""LoRA adapters merged into their base weights: W' = W + (alpha / r) B A (Hu et al. 2021 sec. 4.1, "no additional
inference latency"; peft's ``merge_and_unload``), for an export of the whole model.

Works on full tensors by name (a checkpoint read in one process): a linear's A [r, in] and B [out, r] into its
weight [out, in]; the experts' stacked A [E, r, in] and B [E, out, r] into their [E, out, in] matrices, expert by
expert. The sum is taken in float32 (a bf16 base is widened first); the adapters are dropped from the result.
"""

from __future__ import annotations

from typing import Mapping

import torch

from compiler.lora.modules import base_of, is_adapter


def merged_weights(state: Mapping[str, torch.Tensor], *, scale: float) -> dict[str, torch.Tensor]:
    """``state`` (base weights and adapters by name) with every adapter pair merged into its base: float32 for the
    merged weights, the rest as they are. ValueError when an adapter's pair or base is missing."""
    out = {name: t for name, t in state.items() if not is_adapter(name)}
    for a_name in sorted(n for n in state if is_adapter(n) and n.endswith(("lora_A.weight", "_lora_A"))):
        b_name = a_name[: -len("A.weight")] + "B.weight" if a_name.endswith(".weight") else a_name[:-1] + "B"
        base = base_of(a_name)
        if b_name not in state or base not in state:
            raise ValueError(f"{a_name}: no {b_name if b_name not in state else base} to merge it with")
        a, b = state[a_name].float(), state[b_name].float()
        out[base] = state[base].float() + scale * torch.matmul(b, a)  # [..., out, r] @ [..., r, in]
    return out
