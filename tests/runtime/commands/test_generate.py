"""``run.py generate --prompt TEXT`` with a tokenizer: GPT-2 and Llama 3 folders that carry tokenizer.json encode
the prompt as Hugging Face does (with Llama 3's <|begin_of_text|>), give the reference model's greedy tokens,
print text, and stop at an end-of-sequence id from generation_config.json or tokenizer_config.json; a Qwen3 folder
does the same with the Qwen2-style tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from models import generate
from runtime.commands import generate as generate_command
from runtime.tokenizer import load_tokenizer
from tests.hf_folders import gpt2_config, llama_config, random_values, read_folder, reference_config_4x, write_folder
from tests.hf_reference import pack, parse_safetensors, write_safetensors
from tests.models.gpt2.test_hf import gpt2_forward
from tests.models.llama3.test_llama3_hf import llama_forward
from tests.models.test_generation import STD, full_sequence_greedy
from tests.paths import FIXTURE_ROOT

FIXTURES = FIXTURE_ROOT / "tokenizers"
PROMPT = "The function returns"


def _folder(root: Path, family: str):
    """A tiny model folder with a fixture tokenizer whose vocabulary is the model's, and its reference forward."""
    if family == "gpt2":
        config, style = gpt2_config(n_layer=2, n_embd=32, n_head=2, n_positions=48, tied=False, vocab_size=2000), "gpt2-style"
    else:
        config, style = llama_config(generation=5, layers=2, hidden=32, inner=64, positions=48, vocab_size=2048), "llama3-style"
    folder = write_folder(root / family, config, std=STD["gpt2" if family == "gpt2" else "llama3"])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(FIXTURES / style / name, folder.path / name)
    tensors = read_folder(folder.path)
    if family == "gpt2":
        return folder.path, lambda seq: gpt2_forward(tensors, config, seq)
    return folder.path, lambda seq: llama_forward(tensors, reference_config_4x(config), seq)


def _generate(run_main, argv: list) -> tuple[int, dict, str, str]:
    """(exit code, the result generate prints last, the text it prints before, stderr)."""
    run = run_main(generate_command.main, argv)
    lines = run.out.strip().splitlines()
    return run.code, run.last_json() if run.code == 0 else {}, "\n".join(lines[:-1]), run.err


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_text_in_text_out_with_the_folders_tokenizer(tmp_path, run_main, family):
    path, forward = _folder(tmp_path, family)
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=True)
    assert (prompt[0] == 2032) == (family == "llama")  # Llama 3's post-processor puts <|begin_of_text|> first
    code, result, printed, err = _generate(run_main, ["--init-from", path, "--prompt", PROMPT, "--max-new-tokens", 12,
                                                      "--temperature", 0])
    assert code == 0, err
    greedy = full_sequence_greedy(forward, torch.tensor([prompt]), 12)[0].tolist()
    eos = tokenizer.token_to_id("<|endoftext|>" if family == "gpt2" else "<|end_of_text|>")
    want = greedy[: greedy.index(eos) + 1] if eos in greedy else greedy
    assert result["prompt_ids"] == prompt and result["new_ids"] == want
    assert result["stopped"] == ("eos" if eos in greedy else "length")
    text = tokenizer.decode(prompt + [t for t in want if t != eos], skip_special_tokens=True)
    assert printed == text and text.startswith(PROMPT) and result["text"] == text[len(PROMPT):]
    assert f"the tokenizer of {path}" in err


def test_a_qwen3_folder_with_qwen2s_tokenizer_takes_and_prints_text(tmp_path, run_main):
    """The Qwen3 fixture folder (tests/fixtures/hf-models/qwen3, written by transformers) with its vocabulary
    rows resized to the Qwen2-style tokenizer's 2,051 ids (seeded values) and that tokenizer beside it."""
    source, folder = FIXTURE_ROOT / "hf-models" / "qwen3", tmp_path / "qwen3"
    folder.mkdir()
    config = {**json.loads((source / "config.json").read_text()), "vocab_size": 2051}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, (dtype, shape, raw) in parse_safetensors(source / "model.safetensors")[2].items():
        if shape[0] == 416:  # embed_tokens and lm_head: one row per token id
            shape = [2051, *shape[1:]]
            raw = pack(dtype, random_values(name, shape, seed=0))
        tensors[name] = (dtype, shape, raw)
    write_safetensors(folder / "model.safetensors", tensors)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(FIXTURES / "qwen2-style" / name, folder / name)
    tokenizer = load_tokenizer(folder)
    code, result, printed, err = _generate(run_main, ["--init-from", folder, "--prompt", "Über <|im_start|>" + PROMPT,
                                                      "--max-new-tokens", 10, "--temperature", 0])
    assert code == 0, err
    prompt = tokenizer.encode("Über <|im_start|>" + PROMPT)  # NFC, the special token matched, no bos added
    assert result["prompt_ids"] == prompt and 2049 in prompt and len(result["new_ids"]) >= 1
    new = [t for t in result["new_ids"] if t != 2048]  # <|endoftext|> ends it
    assert printed == tokenizer.decode(prompt + new, skip_special_tokens=True) and printed.startswith("Über " + PROMPT)
    assert result["stopped"] == ("eos" if 2048 in result["new_ids"] else "length")


def test_generation_stops_at_generation_configs_eos(tmp_path, run_main):
    path, forward = _folder(tmp_path, "llama")
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=True)
    greedy = full_sequence_greedy(forward, torch.tensor([prompt]), 12)[0].tolist()
    k = next(i for i in range(2, 12) if greedy[i] not in greedy[:i])  # a token that first appears at step k
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, greedy[k]]}))
    code, result, printed, err = _generate(run_main, ["--init-from", path, "--prompt", PROMPT, "--max-new-tokens", 12,
                                                      "--temperature", 0])
    assert code == 0, err
    assert result["new_ids"] == greedy[: k + 1] and result["stopped"] == "eos"
    assert printed == tokenizer.decode(prompt + greedy[:k], skip_special_tokens=True)


def test_a_tokenizer_for_another_vocabulary_or_none_is_one_error_line(tmp_path, run_main):
    path, _ = _folder(tmp_path, "gpt2")
    code, _, printed, err = _generate(run_main, ["--init-from", path, "--prompt", "x", "--tokenizer", FIXTURES / "qwen2-style"])
    assert code == 2 and err.startswith("error: the tokenizer in")
    assert "2,051 tokens, more than this model's vocabulary (2,000)" in err
    (path / "tokenizer.json").unlink()
    code, _, printed, err = _generate(run_main, ["--init-from", path, "--prompt", "x"])
    assert code == 2 and "no tokenizer.json comes with it; give its tokenizer folder (--tokenizer FOLDER)" in err
    code, result, _, err = _generate(run_main, ["--init-from", path, "--prompt", "x", "--tokenizer", FIXTURES / "gpt2-style",
                                                "--max-new-tokens", 2])
    assert code == 0 and result["prompt_ids"] == load_tokenizer(FIXTURES / "gpt2-style").encode("x"), err


def test_generate_stops_when_every_row_has_stopped():
    class Scripted(torch.nn.Module):
        """Logits that make row r emit the ids of ``script[r]`` in turn (then 0s)."""

        def __init__(self, script):
            super().__init__()
            self.script, self.step = script, 0

        def forward(self, tokens, cache=None):
            logits = torch.zeros(tokens.shape[0], tokens.shape[1], 10)
            for r, ids in enumerate(self.script):
                logits[r, -1, ids[self.step] if self.step < len(ids) else 0] = 1.0
            self.step += 1
            return logits

    model = Scripted([[3, 9, 4, 4], [3, 3, 3, 9]])
    out = generate(model, torch.zeros(2, 1, dtype=torch.long), n_layers=1, max_new_tokens=8, stop_ids=(9,))
    assert out.tolist() == [[3, 9, 4, 4], [3, 3, 3, 9]]  # row 0 stopped at step 2 and ran on until row 1 stopped
    model.step = 0
    assert generate(model, torch.zeros(2, 1, dtype=torch.long), n_layers=1, max_new_tokens=8).shape == (2, 8)
