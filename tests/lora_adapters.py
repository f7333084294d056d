"""LoRA adapters for tests: random, non-zero ones written as a peft folder (``--lora-from``). A run starting from peft's
initial values (B zero) has a zero gradient for every A at its first step, so a first-step gradient check would not
see a wrong A gradient: tests start from these instead."""

from __future__ import annotations

from pathlib import Path

import torch

from compiler.lora import is_adapter
from compiler.parallelize.lora import lora_parameter_shapes
from runtime.checkpoint.peft import write_adapter
from runtime.commands.flags import build_config, build_parser


def without_lora_from(argv: list[str]) -> list[str]:
    if "--lora-from" not in argv:
        return list(argv)
    i = argv.index("--lora-from")
    return argv[:i] + argv[i + 2:]


def write_random_adapter(folder: str | Path, argv: list[str], *, seed: int = 0, std: float = 0.1) -> Path:
    """A peft folder of N(0, std) adapters (A and B) for the model and LoRA flags of training's ``argv`` (its
    ``--lora-from``, if any, left out)."""
    cfg = build_config(build_parser().parse_args(without_lora_from(argv)), now=0)
    generator = torch.Generator().manual_seed(seed)
    adapters = {name: torch.randn(shape, generator=generator) * std
                for name, shape in lora_parameter_shapes(cfg.model, cfg.lora).items() if is_adapter(name)}
    write_adapter(folder, adapters, model_cfg=cfg.model, lora=cfg.lora, base_model=None)
    return Path(folder)
