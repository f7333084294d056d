"""The tokenizer read from tokenizer.json against Hugging Face's own output: the five reference folders of
tests/fixtures/tokenizers (made by tokenizers 0.23.3), every case's ids with and without special tokens and
both decodings, exactly; and the folder's bos / eos from tokenizer_config.json."""

from __future__ import annotations

import json

import pytest

from runtime.tokenizer import load_tokenizer, special_ids
from tests.paths import FIXTURE_ROOT

FIXTURES = FIXTURE_ROOT / "tokenizers"
STYLES = ("gpt2-style", "llama3-style", "qwen2-style", "sentencepiece-style", "o200k-style")


def _cases(style: str) -> list[dict]:
    return json.loads((FIXTURES / style / "expected.json").read_text())["cases"]


@pytest.fixture(scope="module", params=STYLES)
def style(request):
    return request.param, load_tokenizer(FIXTURES / request.param)


def test_every_case_gives_hugging_faces_ids_and_texts(style):
    name, tokenizer = style
    cases = _cases(name)
    assert len(cases) == 8
    for case in cases:
        text = (FIXTURES / name / case["file"]).read_bytes().decode("utf-8")
        assert tokenizer.encode(text) == case["ids"], case["name"]
        assert tokenizer.encode(text, add_special_tokens=True) == case["ids_with_special"], case["name"]
        assert tokenizer.decode(case["ids"]) == case["decoded"], case["name"]
        assert tokenizer.decode(case["ids_with_special"]) == case["decoded_with_special"], case["name"]


def test_the_token_strings_are_hugging_faces(style):
    name, tokenizer = style
    for case in _cases(name):
        assert [tokenizer.added.token(i) or tokenizer.model.id_to_token[i] for i in case["ids"]] == case["tokens"]


@pytest.mark.parametrize("name, bos, eos, vocab", [
    ("gpt2-style", "<|endoftext|>", "<|endoftext|>", 2000), ("llama3-style", "<|begin_of_text|>", "<|end_of_text|>", 2048),
    ("qwen2-style", None, "<|endoftext|>", 2051), ("sentencepiece-style", "<s>", "</s>", 2000),
    ("o200k-style", "<|startoftext|>", "<|return|>", 2057)])
def test_bos_and_eos_come_from_tokenizer_config(name, bos, eos, vocab):
    tokenizer = load_tokenizer(FIXTURES / name)
    ids = special_ids(FIXTURES / name, tokenizer)
    assert ids.bos == (tokenizer.token_to_id(bos) if bos else None) and ids.eos == tokenizer.token_to_id(eos)
    assert tokenizer.vocab_size == vocab
    assert tokenizer.is_special(ids.eos)


def test_special_tokens_are_skipped_on_request_and_kept_as_text_when_split():
    tokenizer = load_tokenizer(FIXTURES / "llama3-style")
    ids = tokenizer.encode("Hi<|eot_id|>there", add_special_tokens=True)
    eot = tokenizer.token_to_id("<|eot_id|>")
    assert ids[0] == tokenizer.token_to_id("<|begin_of_text|>") and eot in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hithere"
    plain = tokenizer.encode("Hi<|eot_id|>there", split_special_tokens=True)
    assert eot not in plain and tokenizer.decode(plain) == "Hi<|eot_id|>there"
