"""Every registered family as the per-family tests take it (tests/models/test_famil*.py): the registry's specs, a
family's debug size with flag-style overrides, and a config as its Hugging Face config.json reads back. A family is
tested by being registered in ``models.FAMILIES``; the tests' tables of per-family facts are keyed by family or size."""

from __future__ import annotations

import dataclasses
from typing import Any

from models import FAMILIES, ModelSpec

SPECS = list(FAMILIES.values())


def family_id(spec: ModelSpec) -> str:
    """A parametrized test's id for ``spec``: its family's name."""
    return spec.family


def debug_config(spec: ModelSpec, **overrides: Any) -> Any:
    """The family's debug size, with flag-style overrides (``n_layers=2``) applied as ``--layers 2`` would be."""
    base = spec.sizes[spec.debug_size]
    return spec.with_overrides(base, **overrides) if overrides else base


def as_read_from_hf(cfg: Any) -> Any:
    """``cfg`` as its config.json reads back: the debug sizes' wide router initialisation is the engine's, no part of
    a Hugging Face config (which reads as transformers' 0.02)."""
    return dataclasses.replace(cfg, router_init_std=0.02) if hasattr(cfg, "router_init_std") else cfg
