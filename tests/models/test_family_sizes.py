"""Every named size of every registered family: the published ones against what their authors state (parameter
counts, total and activated; the tensor-parallel degrees their head counts split into), and every size's FLOPs per
token against the model it builds. A new family's published sizes are rows of ``PUBLISHED``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from models import MODEL_NAMES, MoE, activated_parameter_count, flops_per_token, parameter_count
from models.spec import MP


@dataclass(frozen=True)
class Published:
    """A size's parameter counts as published: an int exactly, a string ("0.6B") to within one unit of its last
    digit (cards round, or cut: Qwen3-30B-A3B activates 3.35B and says 3.3B). A row stating no activated count is a
    dense model's, which activates every parameter."""

    total: int | str
    max_mp: int  # the most tensor-parallel ranks, a power of two, its head counts split into (twice that: not)
    activated: int | str | None = None  # per token, as model cards count: the embedding lookup included
    activated_without_lookup: int | str | None = None  # per token, the token embedding left out (DeepSeek's count)
    non_embedding: int | str | None = None  # less the token embedding and the head


PUBLISHED = {
    # GPT-2 (OpenAI's released checkpoints: every tensor of GPT2LMHeadModel, the tied head once), exactly.
    "small": Published(124_439_808, max_mp=4), "medium": Published(354_823_168, max_mp=16),
    "large": Published(774_030_080, max_mp=4),
    # Llama 3.1 and 3.2: Meta's model cards / params.json, exactly.
    "llama3-1b": Published(1_235_814_400, max_mp=8), "llama3-3b": Published(3_212_749_824, max_mp=8),
    "llama3-8b": Published(8_030_261_248, max_mp=8), "llama3-70b": Published(70_553_706_496, max_mp=8),
    "llama3-405b": Published(405_853_388_800, max_mp=8),
    # Qwen3's cards ("Number of Parameters: 0.6B; Number of Paramaters (Non-Embedding): 0.44B", ..., "30.5B in total
    # and 3.3B activated", "235B in total and 22B activated").
    "qwen3-0.6b": Published("0.6B", max_mp=8, non_embedding="0.44B"),
    "qwen3-1.7b": Published("1.7B", max_mp=8, non_embedding="1.4B"),
    "qwen3-4b": Published("4.0B", max_mp=8, non_embedding="3.6B"),
    "qwen3-8b": Published("8.2B", max_mp=8, non_embedding="6.95B"),
    "qwen3-14b": Published("14.8B", max_mp=8, non_embedding="13.2B"),
    "qwen3-32b": Published("32.8B", max_mp=8, non_embedding="31.2B"),
    "qwen3-30b-a3b": Published("30.5B", max_mp=4, activated="3.3B", non_embedding="29.9B"),
    "qwen3-235b-a22b": Published("235B", max_mp=4, activated="22B", non_embedding="234B"),
    # Mistral's announcements (Mixtral 8x7B: "46.7B total parameters but only uses 12.9B parameters per token";
    # 8x22B: "39B active parameters out of 141B").
    "mixtral-8x7b": Published("46.7B", max_mp=8, activated="12.9B"),
    "mixtral-8x22b": Published("141B", max_mp=8, activated="39B"),
    # DeepSeek, activated without the embedding lookup (the V3 report's abstract: "671B total parameters with 37B
    # activated for each token"; DeepSeek-V2-Lite's card: "15.7B total parameters, 2.4B activated" (2.66B with the
    # token embedding, 2.45B without)). V3's counts leave out its MTP module (14B).
    "deepseek-v3": Published("671B", max_mp=128, activated_without_lookup="37B"),
    "deepseek-v3-16b": Published("15.7B", max_mp=16, activated_without_lookup="2.4B"),
    # OpenAI's gpt-oss model card (2025): 20.91B total, 3.61B active; 116.83B, 5.13B (active: every parameter but the
    # embedding table, 4 experts per block, their biases included).
    "gpt-oss-20b": Published("20.91B", max_mp=8, activated_without_lookup="3.61B"),
    "gpt-oss-120b": Published("116.83B", max_mp=8, activated_without_lookup="5.13B"),
}


def _agrees(count: int, published: int | str) -> bool:
    """``count`` is what ``published`` states: an int exactly; "0.44B" within one unit of its last digit."""
    if isinstance(published, int):
        return count == published
    decimals = len(published[:-1].partition(".")[2])
    return abs(count / 1e9 - float(published[:-1])) < 10.0 ** -decimals


def test_every_named_size_but_the_debug_sizes_has_a_published_row():
    assert set(PUBLISHED) == {name for name, (spec, _) in MODEL_NAMES.items()
                              if name != spec.debug_size and not name.endswith("-debug")}


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_published_sizes_have_the_published_parameter_counts(size):
    _, cfg = MODEL_NAMES[size]
    stated = PUBLISHED[size]
    total, activated = parameter_count(cfg), activated_parameter_count(cfg)
    assert _agrees(total, stated.total), total
    if stated.activated is None and stated.activated_without_lookup is None:
        assert activated == total, activated  # a dense model
    if stated.activated is not None:
        assert _agrees(activated, stated.activated), activated
    if stated.activated_without_lookup is not None:
        lookup = cfg.vocab_size * cfg.d_model
        assert _agrees(activated - lookup, stated.activated_without_lookup), activated - lookup
    if stated.non_embedding is not None:
        embeddings = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
        assert _agrees(total - embeddings, stated.non_embedding), total - embeddings


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_published_sizes_run_on_their_largest_tensor_parallel_degree_and_not_on_twice_it(size):
    spec, cfg = MODEL_NAMES[size]
    mp = PUBLISHED[size].max_mp
    assert spec.check(cfg, mp) is None
    problem = spec.check(cfg, 2 * mp)
    assert problem is not None and (problem.field, problem.value) == (MP, 2 * mp) and mp in problem.valid, problem


def _matrix_product_parameters_per_token(model: nn.Module) -> int:
    """Every trained parameter but the embedding lookups (a table read, no product: token and learned position
    embeddings); of each MoE block's experts, the top_k of n_experts a token visits."""
    lookups = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    n = sum(p.numel() for name, p in model.named_parameters() if name not in lookups and p.requires_grad)
    for m in model.modules():
        if isinstance(m, MoE):
            n -= sum(p.numel() for p in m.experts.parameters()) * (m.experts.n_experts - m.top_k) // m.experts.n_experts
    return n


@pytest.mark.parametrize("size", list(MODEL_NAMES))
def test_flops_per_token_counts_a_tokens_matrix_products(size):
    spec, cfg = MODEL_NAMES[size]
    with torch.device("meta"):
        model = spec.build(cfg, share_tied_weights=False)  # the head is a product even when it shares its weight
    latent = spec.latent_attention(cfg)
    qk, v = (latent.qk_dim, latent.v_dim) if latent else (cfg.head_dim, cfg.head_dim)
    # PaLM's 6N plus attention's QK^T over qk features and AV over v, forward and backward, every query head, over
    # the keys a query sees: T on a full layer, the window on a sliding one (gpt-oss's layer_types).
    window = getattr(cfg, "window", lambda layer: None)
    keys = sum(min(cfg.seq_len, window(layer) or cfg.seq_len) for layer in range(cfg.n_layers))
    attention = 6 * keys * cfg.n_heads * (qk + v)
    assert flops_per_token(cfg) == 6 * _matrix_product_parameters_per_token(model) + attention
