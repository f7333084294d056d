"""Decoding with a KV cache (models/kv_cache.py, models/generation.py) and ``run.py generate``: greedy tokens
equal a loop that runs the whole sequence every step, for both families (GQA, RoPE, learned positions);
sampling; the command on Hugging Face folders against a reference forward of the folder's tensors; its
one-line errors. (From a checkpoint: tests/launches/test_hf_runs.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import KVCache, build_model, generate, named_config
from models.generation import next_token
from runtime.commands import generate as generate_command
from tests.hf_folders import gpt2_config, llama_config, read_folder, reference_config_4x, write_folder
from tests.models.gpt2.test_hf import gpt2_forward
from tests.models.llama3.test_llama3_hf import llama_forward

CONFIGS = {
    "gpt2-untied": dataclasses.replace(named_config("tiny"), tie_embeddings=False),
    "gpt2-tied": named_config("tiny"),
    "llama-gqa-scaled-rope": named_config("llama3-debug"),  # 4 heads over 2 key/value heads, llama3 scaling
    "llama-one-kv-head-plain-rope": dataclasses.replace(named_config("llama3-debug", n_kv_heads=1), rope_factor=None),
    "llama-head-dim-24": dataclasses.replace(named_config("llama3-debug"), head_dim=24, tie_embeddings=False),
}
# Random weights whose greedy decoding varies (at GPT-2's 0.02 it repeats one token; a tied GPT-2 repeats
# at any scale: a token's embedding is nearest to itself): (embedding std, other matrices' std).
STD = {"gpt2": (1.0, 0.05), "llama3": (0.3, 0.3)}


def _random_model(cfg):
    model = build_model(cfg, seed=0)
    embedding_std, std = STD[cfg.family]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((embedding_std if "emb" in name else std) * torch.randn(p.shape, generator=g))
    return model.eval()


def full_sequence_greedy(forward, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """The loop without a cache: the whole sequence through ``forward`` for every new token."""
    seq = prompt
    with torch.no_grad():
        for _ in range(steps):
            seq = torch.cat([seq, forward(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompt.shape[1]:]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_decoding_with_the_cache_gives_the_tokens_of_the_full_sequence_loop(name):
    cfg = CONFIGS[name]
    model = _random_model(cfg)
    prompt = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    steps = cfg.context - prompt.shape[1]  # up to the last position of the model's context (GPT-2: its table)
    got = generate(model, prompt, n_layers=cfg.n_layers, max_new_tokens=steps)
    assert got.shape == (2, steps)
    if name != "gpt2-tied":  # varied output: a wrong cache could not hide behind a repeated token
        assert len(set(got[0].tolist())) > 5, got[0]
    assert torch.equal(got, full_sequence_greedy(model, prompt, steps))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_chunks_give_the_logits_of_one_forward(name):
    # Several new tokens at once after cached ones: the mask is causal at the cache's offset.
    cfg = CONFIGS[name]
    model = _random_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    cache = KVCache(cfg.n_layers, capacity=20)
    with torch.no_grad():
        chunks = [model(tokens[:, a:b], cache=cache) for a, b in ((0, 3), (3, 11), (11, 12), (12, 20))]
        torch.testing.assert_close(torch.cat(chunks, dim=1), model(tokens), rtol=1e-5, atol=1e-4)
    assert cache.length == 20
    with pytest.raises(ValueError, match="holds 20 positions"):
        model(tokens[:, :1], cache=cache)


def test_sampling_keeps_to_the_top_k_and_repeats_with_a_seed():
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0, 2.5]])
    assert next_token(logits, temperature=0, top_k=None).tolist() == [1]
    draws = [next_token(logits, temperature=5.0, top_k=2, generator=torch.Generator().manual_seed(s)).item()
             for s in range(200)]
    assert set(draws) == {1, 4}  # the two most likely only, both drawn at a high temperature
    again = [next_token(logits, temperature=5.0, top_k=2, generator=torch.Generator().manual_seed(s)).item()
             for s in range(200)]
    assert draws == again
    assert set(next_token(logits.expand(400, 5), temperature=1.0, top_k=None,
                          generator=torch.Generator().manual_seed(0)).tolist()) == {0, 1, 2, 3, 4}


# ---- run.py generate on Hugging Face folders ----

@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_from_a_folder_gives_the_reference_models_greedy_tokens(tmp_path, run_main, family):
    if family == "gpt2":
        config = gpt2_config(n_layer=2, n_embd=32, n_head=2, n_positions=48, tied=False)
    else:  # token ids: a vocabulary that is not bytes
        config = llama_config(generation=5, layers=2, hidden=32, inner=64, positions=48, vocab_size=300)
    folder = write_folder(tmp_path / family, config, std=STD["gpt2" if family == "gpt2" else "llama3"])
    tensors = read_folder(folder.path)
    if family == "gpt2":
        prompt, argv = list("Hi, é".encode()), ["--prompt", "Hi, é"]
        forward = lambda seq: gpt2_forward(tensors, config, seq)  # noqa: E731
    else:
        prompt, argv = [5, 200, 17], ["--prompt-ids", "5,200,17"]
        forward = lambda seq: llama_forward(tensors, reference_config_4x(config), seq)  # noqa: E731
    new = 48 - len(prompt) + 1  # every position, the last new token never fed back
    run = run_main(generate_command.main, ["--init-from", folder.path, *argv, "--max-new-tokens", new, "--temperature", 0])
    assert run.code == 0, run.err
    result = run.last_json()
    want = full_sequence_greedy(forward, torch.tensor([prompt]), new)[0].tolist()
    assert result["prompt_ids"] == prompt and result["new_ids"] == want
    assert len(set(want)) > 5
    if family == "gpt2":  # byte-level: text out too
        assert result["text"] == bytes(want).decode("utf-8", errors="replace")
        assert run.out.strip().splitlines()[0].startswith("Hi, é")
    else:
        assert "text" not in result


def test_sampled_generation_repeats_with_its_seed(tmp_path, run_main):
    folder = write_folder(tmp_path / "m", llama_config(generation=4, layers=2, hidden=32, inner=64))
    argv = ["--init-from", str(folder.path), "--prompt", "abc", "--max-new-tokens", "12", "--temperature", "1.5"]
    runs = [run_main(generate_command.main, [*argv, "--seed", seed]).last_json()["new_ids"] for seed in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize(("argv", "words"), [
    (["--prompt", "x"], ["one of the arguments --checkpoint --init-from is required"]),
    (["--init-from", "{bytes}", "--checkpoint", "c", "--prompt", "x"], ["--checkpoint", "not allowed with", "--init-from"]),
    (["--init-from", "{bytes}"], ["one of the arguments --prompt --prompt-ids --messages --user is required"]),
    (["--init-from", "{bytes}", "--prompt", "x" * 33], ["the prompt has 33 tokens", "at most 32 positions"]),
    (["--init-from", "{bytes}", "--prompt", "x" * 30, "--max-new-tokens", "4"],
     ["--max-new-tokens 4", "need 33 positions", "has 32", "at most 3 new tokens"]),
    (["--init-from", "{ids}", "--prompt", "hello"], ["--prompt", "vocabulary has 300 tokens", "--prompt-ids"]),
    (["--init-from", "{ids}", "--prompt-ids", "1,300"], ["--prompt-ids", "token id 300", "0 to 299"]),
    (["--init-from", "{ids}", "--prompt-ids", "1,a"], ["--prompt-ids '1,a'", "comma-separated integers"]),
    (["--init-from", "{bytes}", "--prompt", "x", "--temperature", "-1"], ["--temperature", ">= 0"]),
    (["--init-from", "{bytes}/config.json", "--prompt", "x"], ["not a folder", "--checkpoint"]),
])
def test_bad_generate_input_is_one_error_line(tmp_path, run_main, argv, words):
    byte_level = write_folder(tmp_path / "bytes", gpt2_config(n_positions=32, n_layer=1, n_embd=16, n_head=2))
    ids = write_folder(tmp_path / "ids", gpt2_config(n_positions=32, n_layer=1, n_embd=16, n_head=2, vocab_size=300))
    argv = [a.format(bytes=byte_level.path, ids=ids.path) for a in argv]
    code, out, err = run_main(generate_command.main, argv)
    lines = [line for line in (out + err).splitlines() if line]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    for word in words:
        assert word in lines[0], lines[0]
