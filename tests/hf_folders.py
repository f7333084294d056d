"""Hugging Face model folders for the tests, written by hand from the published layouts: ``config.json`` as
transformers writes it (4.x and 5.x for Llama), tensor names and shapes of ``GPT2LMHeadModel`` and
``LlamaForCausalLM``, and the bytes through the independent safetensors writer of tests/hf_reference.py
(struct and json; no code of ours). Values are seeded Python floats, so a folder is the same every time.

``read_folder`` parses a folder back with the same reference code, for reference forwards that never touch
the engine's reader.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.hf_reference import ITEMSIZE, pack, parse_safetensors, unpack, write_index, write_safetensors

# Published layouts (transformers' modeling_gpt2.py / modeling_llama.py state dicts); shapes from the config.


def gpt2_tensors(config: dict) -> dict[str, list[int]]:
    """GPT2LMHeadModel: Conv1D weights stored [in, out]; c_attn's output is [Q | K | V]."""
    d, n_pos, vocab = config["n_embd"], config["n_positions"], config["vocab_size"]
    inner = config.get("n_inner") or 4 * d
    shapes = {"transformer.wte.weight": [vocab, d], "transformer.wpe.weight": [n_pos, d]}
    for i in range(config["n_layer"]):
        p = f"transformer.h.{i}"
        shapes.update({
            f"{p}.ln_1.weight": [d], f"{p}.ln_1.bias": [d],
            f"{p}.attn.c_attn.weight": [d, 3 * d], f"{p}.attn.c_attn.bias": [3 * d],
            f"{p}.attn.c_proj.weight": [d, d], f"{p}.attn.c_proj.bias": [d],
            f"{p}.ln_2.weight": [d], f"{p}.ln_2.bias": [d],
            f"{p}.mlp.c_fc.weight": [d, inner], f"{p}.mlp.c_fc.bias": [inner],
            f"{p}.mlp.c_proj.weight": [inner, d], f"{p}.mlp.c_proj.bias": [d],
        })
    shapes.update({"transformer.ln_f.weight": [d], "transformer.ln_f.bias": [d]})
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = [vocab, d]
    return shapes


def llama_tensors(config: dict) -> dict[str, list[int]]:
    """LlamaForCausalLM: nn.Linear weights stored [out, in]; no biases; lm_head only when untied."""
    d, vocab, inner = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // heads
    shapes = {"model.embed_tokens.weight": [vocab, d]}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": [d], f"{p}.self_attn.q_proj.weight": [heads * hd, d],
            f"{p}.self_attn.k_proj.weight": [kv_heads * hd, d], f"{p}.self_attn.v_proj.weight": [kv_heads * hd, d],
            f"{p}.self_attn.o_proj.weight": [d, heads * hd], f"{p}.post_attention_layernorm.weight": [d],
            f"{p}.mlp.gate_proj.weight": [inner, d], f"{p}.mlp.up_proj.weight": [inner, d],
            f"{p}.mlp.down_proj.weight": [d, inner],
        })
    shapes["model.norm.weight"] = [d]
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = [vocab, d]
    return shapes


def gpt2_config(*, n_layer=4, n_embd=64, n_head=4, n_positions=32, vocab_size=256, tied=True) -> dict:
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
              "n_positions": n_positions, "n_ctx": n_positions, "n_embd": n_embd, "n_layer": n_layer,
              "n_head": n_head, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
              "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "initializer_range": 0.02,
              "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32", "transformers_version": "4.44.2"}
    if not tied:
        config["tie_word_embeddings"] = False
    return config


def llama_config(*, generation: int, layers=4, hidden=64, heads=4, kv_heads=2, head_dim=None, inner=192,
                 positions=128, tied=True, llama3_scaling=True, vocab_size=256) -> dict:
    """config.json of transformers 4.x (rope_theta + rope_scaling) or 5.x (rope_parameters, head_dim)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
              "hidden_size": hidden, "intermediate_size": inner, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_act": "silu",
              "max_position_embeddings": positions, "rms_norm_eps": 1e-5, "attention_bias": False,
              "mlp_bias": False, "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2}
    # llama3 scaling with an original context of 16, shorter than the test sequences, so it changes the logits
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16} if llama3_scaling else None
    if generation == 4:
        config.update(rope_theta=10000.0, rope_scaling=scaling, torch_dtype="float32", transformers_version="4.45.0")
        if head_dim:
            config["head_dim"] = head_dim
    else:
        config.update(rope_parameters={"rope_theta": 10000.0, **(scaling or {"rope_type": "default"})},
                      head_dim=head_dim or hidden // heads, dtype="float32", transformers_version="5.0.0")
    return config


def reference_config_4x(config: dict) -> dict:
    """A 5.x config in 4.x keys, for the reference forward of tests/models/llama3/test_llama3_hf.py."""
    if "rope_parameters" not in config:
        return config
    params = dict(config["rope_parameters"])
    theta = params.pop("rope_theta")
    return {**config, "rope_theta": theta, "rope_scaling": params if params.get("rope_type") != "default" else None}


def random_values(name: str, shape: list[int], *, seed: int, std: tuple[float, float] = (0.3, 0.3)) -> list[float]:
    """Seeded by (seed, name): norm weights near 1, biases small, embeddings N(0, std[0]^2), the other matrices
    N(0, std[1]^2). At GPT-2's initial 0.02, greedy decoding of a random model repeats one token; (0.3, 0.3)
    varies for Llama, (1.0, 0.05) for an untied GPT-2."""
    rng = random.Random(f"{seed}:{name}")
    n = torch.Size(shape).numel()
    if name.endswith("bias"):
        return [rng.gauss(0, 0.1) for _ in range(n)]
    if name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
        return [1.0 + rng.gauss(0, 0.1) for _ in range(n)]
    embedding = name.endswith(("wte.weight", "wpe.weight", "embed_tokens.weight"))
    return [rng.gauss(0, std[0] if embedding else std[1]) for _ in range(n)]


@dataclass(frozen=True)
class Folder:
    path: Path
    config: dict
    names: tuple[str, ...]  # the tensors written


def write_folder(path: Path, config: dict, *, seed: int = 0, dtype: str = "F32", shards: int = 1,
                 extra: dict[str, list[int]] | None = None, drop_prefix: bool = False,
                 std: tuple[float, float] = (0.3, 0.3)) -> Folder:
    """config.json and the family's tensors as ``model.safetensors`` or ``shards`` files plus the index.
    ``extra``: more tensors to write (e.g. GPT-2's old attention-mask buffers); ``drop_prefix``: names without
    their first component, as a base model (GPT2Model) saves them."""
    path.mkdir(parents=True)
    shapes = gpt2_tensors(config) if config["model_type"] == "gpt2" else llama_tensors(config)
    shapes.update(extra or {})
    tensors = {}
    for name, shape in shapes.items():
        stored = name.split(".", 1)[1] if drop_prefix and not name.startswith("lm_head") else name
        tensors[stored] = (dtype, shape, pack(dtype, random_values(name, shape, seed=seed, std=std)))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if shards == 1:
        write_safetensors(path / "model.safetensors", tensors, metadata={"format": "pt"})
        return Folder(path, config, tuple(tensors))
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
        write_safetensors(path / file, part, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        total += sum(len(raw) for _, _, raw in part.values())
    write_index(path / "model.safetensors.index.json", weight_map, total)
    return Folder(path, config, tuple(tensors))


def read_folder(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files, parsed by the reference parser, as fp32 torch tensors."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        _, _, tensors = parse_safetensors(file)
        for name, (dtype, shape, raw) in tensors.items():
            assert len(raw) == ITEMSIZE[dtype] * torch.Size(shape).numel()
            out[name] = torch.tensor(unpack(dtype, raw), dtype=torch.float64).float().reshape(shape)
    return out
