"""``run.py generate --chat``: a Llama model folder with Llama 3's chat tokenizer (the llama3-style chat fixture:
its template, vocabulary 2,048) renders the conversation as transformers does with a generation prompt (the
fixture's ids), gives the reference model's greedy tokens, and stops at <|eot_id|>, the end-of-turn id of its
generation_config.json, which plain --prompt generation does not stop at."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from runtime.commands import generate as generate_command
from runtime.tokenizer import load_tokenizer
from runtime.tokenizer.chat import ChatTemplate
from tests.chat_data import CHAT_TOKENIZERS
from tests.hf_folders import llama_config, read_folder, reference_config_4x, write_folder
from tests.hf_reference import pack, write_safetensors
from tests.models.llama3.test_llama3_hf import llama_forward
from tests.models.test_generation import STD, full_sequence_greedy

STYLE = CHAT_TOKENIZERS / "llama3-style"
END_OF_TEXT, END_OF_TURN = 2033, 2041  # <|end_of_text|> (the tokenizer's eos), <|eot_id|>
STEPS = 24


def _fixture_case(name: str) -> tuple[dict, dict]:
    cases = json.loads((STYLE / "cases.json").read_text())["cases"]
    expected = json.loads((STYLE / "expected.json").read_text())["cases"]
    return next((c, e) for c, e in zip(cases, expected) if c["name"] == name)


def _greedy(tensors: dict, config: dict, prompt: list[int]) -> list[int]:
    forward = lambda seq: llama_forward(tensors, reference_config_4x(config), seq)  # noqa: E731
    return full_sequence_greedy(forward, torch.tensor([prompt]), STEPS)[0].tolist()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> tuple[Path, list[int], list[int]]:
    """(folder, the chat prompt's ids, the reference's greedy continuation). The untied head's <|eot_id|> row is made
    twice the row of a token the random model writes a few steps in, so the answer ends with <|eot_id|> there."""
    case, expected = _fixture_case("generation_prompt")
    config = llama_config(generation=5, layers=2, hidden=32, inner=64, positions=128, vocab_size=2048, tied=False)
    folder = write_folder(tmp_path_factory.mktemp("chat") / "llama", config, std=STD["llama3"]).path
    tensors = read_folder(folder)
    greedy = _greedy(tensors, config, expected["ids"])
    k = next(i for i in range(2, STEPS) if greedy[i] not in greedy[:i] and greedy[i] != END_OF_TURN)
    tensors["lm_head.weight"][END_OF_TURN] = 2 * tensors["lm_head.weight"][greedy[k]]
    write_safetensors(folder / "model.safetensors", {name: ("F32", list(t.shape), pack("F32", t.flatten().tolist()))
                                                     for name, t in tensors.items()})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(STYLE / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [END_OF_TEXT, END_OF_TURN]}))
    greedy = _greedy(tensors, config, expected["ids"])
    assert END_OF_TURN in greedy, "the engineered head must make the model end its turn"
    (folder / "messages.json").write_text(json.dumps(case["messages"]))
    return folder, expected["ids"], greedy


def _generate(argv: list, capsys) -> tuple[int, dict, str, str]:
    code = generate_command.main([str(a) for a in argv])
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    return code, json.loads(lines[-1]) if code == 0 else {}, "\n".join(lines[:-1]), out.err


def test_chat_generation_stops_at_the_end_of_turn_id(chat_model, capsys):
    folder, prompt, greedy = chat_model
    code, result, printed, err = _generate(["--init-from", folder, "--chat", "--messages", folder / "messages.json",
                                            "--max-new-tokens", STEPS, "--temperature", 0], capsys)
    assert code == 0, err
    assert result["prompt_ids"] == prompt  # transformers' render of the fixture with add_generation_prompt
    end = greedy.index(END_OF_TURN)
    assert result["new_ids"] == greedy[: end + 1] and result["stopped"] == "eos"
    answer = load_tokenizer(folder).decode(greedy[:end], skip_special_tokens=True)
    assert printed == answer == result["text"]


def test_without_generation_config_chat_still_stops_and_plain_generation_does_not(chat_model, capsys):
    """Without generation_config.json the stop ids of --prompt-ids are the tokenizer's eos alone (<|end_of_text|>):
    the model writes past its end of turn; --chat finds <|eot_id|> among the tokenizer's end-of-turn tokens."""
    folder, prompt, greedy = chat_model
    end = greedy.index(END_OF_TURN)
    (folder / "generation_config.json").rename(folder / "generation_config.off")
    try:
        code, result, _, err = _generate(["--init-from", folder, "--prompt-ids", ",".join(map(str, prompt)),
                                          "--max-new-tokens", end + 2, "--temperature", 0], capsys)
        assert code == 0, err
        assert result["new_ids"] == greedy[: end + 2] and result["stopped"] == "length"
        code, result, _, err = _generate(["--init-from", folder, "--chat", "--messages", folder / "messages.json",
                                          "--max-new-tokens", STEPS, "--temperature", 0], capsys)
        assert code == 0, err
        assert result["new_ids"] == greedy[: end + 1] and result["stopped"] == "eos"
    finally:
        (folder / "generation_config.off").rename(folder / "generation_config.json")


def test_repeated_user_flags_are_user_messages(chat_model, capsys):
    folder, _, _ = chat_model
    code, result, _, err = _generate(["--init-from", folder, "--user", "Hi", "--user", "again", "--max-new-tokens", 2,
                                      "--temperature", 0], capsys)
    assert code == 0, err
    text = ChatTemplate.from_folder(folder).render([{"role": "user", "content": "Hi"}, {"role": "user", "content": "again"}],
                                                   add_generation_prompt=True)
    assert text.endswith("again<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert result["prompt_ids"] == load_tokenizer(folder).encode(text)


def test_a_conversation_the_template_refuses_is_one_error_line(chat_model, capsys, tmp_path):
    folder, _, _ = chat_model
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"messages": [{"role": "wizard", "content": "x"}]}))
    code, _, _, err = _generate(["--init-from", folder, "--messages", bad], capsys)
    assert code == 2 and err.startswith("error: --messages ") and "unknown role 'wizard'" in err
    code, _, _, err = _generate(["--init-from", folder, "--chat", "--prompt-ids", "1,2"], capsys)
    assert code == 2 and "--chat needs the conversation" in err
