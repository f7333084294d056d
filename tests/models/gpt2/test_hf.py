"""Hugging Face GPT-2 layout: a GPT-2 forward written against that layout (checked against transformers' own
logits in tests/models/test_hf_fixtures.py, which also runs our model on a tied GPT-2 folder transformers wrote) gives
our model's logits from the exported tensors of an untied model, and the inverse mapping gives our weights back."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models import build_model, named_config, spec_of

TINY = named_config("tiny", seq_len=16)
HF = spec_of(TINY).hf


def to_hf_gpt2(state, cfg):
    return HF.to_hf(state, cfg)


def hf_config(cfg):
    return HF.config_to_hf(cfg)


def from_hf_gpt2(hf, cfg, names):
    """Our tensors, each read from the Hugging Face tensors ``from_hf`` names (as a loader does)."""
    out = {}
    for name in names:
        sources, combine = HF.from_hf(name, cfg)
        out[name] = combine(*(hf[s] for s in sources))
    return out


def gpt2_forward(hf: dict[str, torch.Tensor], config: dict, tokens: torch.Tensor) -> torch.Tensor:
    """GPT2LMHeadModel's forward from its state dict: Conv1D is x @ W + b (W stored [in, out]);
    c_attn's output splits into [Q | K | V] of n_embd each, heads contiguous within each."""
    d, h = config["n_embd"], config["n_head"]
    eps = config["layer_norm_epsilon"]
    B, T = tokens.shape

    def conv1d(x, name):
        return x @ hf[f"{name}.weight"] + hf[f"{name}.bias"]

    def ln(x, name):
        return F.layer_norm(x, (d,), hf[f"{name}.weight"], hf[f"{name}.bias"], eps)

    x = hf["transformer.wte.weight"][tokens] + hf["transformer.wpe.weight"][:T]
    for i in range(config["n_layer"]):
        p = f"transformer.h.{i}"
        q, k, v = conv1d(ln(x, f"{p}.ln_1"), f"{p}.attn.c_attn").split(d, dim=2)
        q, k, v = (t.view(B, T, h, d // h).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // h)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d)
        x = x + conv1d(y, f"{p}.attn.c_proj")
        hidden = F.gelu(conv1d(ln(x, f"{p}.ln_2"), f"{p}.mlp.c_fc"), approximate="tanh")  # gelu_new
        x = x + conv1d(hidden, f"{p}.mlp.c_proj")
    head = hf["lm_head.weight"] if not config["tie_word_embeddings"] else hf["transformer.wte.weight"]
    return ln(x, "transformer.ln_f") @ head.t()


def test_an_untied_gpt2_layout_computes_our_logits_and_maps_back():
    tied = False  # the tied layout: tests/models/test_hf_fixtures.py, against transformers
    cfg = named_config("tiny", seq_len=16, tie_embeddings=tied)
    model = build_model(cfg, seed=7)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    hf = to_hf_gpt2(state, cfg)
    config = hf_config(cfg)

    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (cfg.d_model, 3 * cfg.d_model)  # Conv1D: [in, out]
    assert hf["transformer.h.0.mlp.c_fc.weight"].shape == (cfg.d_model, cfg.mlp_width)
    assert config["tie_word_embeddings"] is tied and config["activation_function"] == "gelu_new"
    assert ("lm_head.weight" in hf) is not tied  # Hugging Face does not save a tied head
    assert HF.config_from_hf(config) == cfg

    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(gpt2_forward(hf, config, tokens), model(tokens), rtol=1e-5, atol=1e-5)

    back = from_hf_gpt2(hf, cfg, list(state))
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_gpt2_small_writes_gpt2s_config_and_token_ids():
    """(Every GPT-2 size's parameter count: tests/models/test_family_sizes.py.)"""
    config = hf_config(named_config("small"))
    assert (config["n_embd"], config["n_layer"], config["n_head"], config["n_positions"]) == (768, 12, 12, 1024)
    assert config["eos_token_id"] == 50256
