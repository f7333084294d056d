"""The tokenizer beyond the reference cases: round trips over every kind of text (all letters and digits,
whitespace runs, CRLF, emoji sequences, long words, empty input), the BPE merge orders, merges in both file
forms, ignore_merges, byte fallback and unknown tokens, added-token options, decoders, the Metaspace
spelling, the chunk cache and segments against whole-text ids, and one-line errors naming the field."""

from __future__ import annotations

import copy
import json
import random
import unicodedata

import pytest

from runtime.tokenizer import TokenizerError, load_tokenizer
from runtime.tokenizer.json_fields import Node
from runtime.tokenizer.segments import cut_pattern, segments
from runtime.tokenizer.tokenizer import Tokenizer
from tests.paths import FIXTURE_ROOT

FIXTURES = FIXTURE_ROOT / "tokenizers"
BYTE_LEVEL = ("gpt2-style", "llama3-style", "qwen2-style", "o200k-style")


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    return {name: load_tokenizer(FIXTURES / name) for name in (*BYTE_LEVEL, "sentencepiece-style")}


def _spec(name: str) -> dict:
    return json.loads((FIXTURES / name / "tokenizer.json").read_text())


def _build(spec: dict) -> Tokenizer:
    return Tokenizer(Node.root(spec, "tokenizer.json"))


PIECES = ["a", "Z", "word", " the", "é", "ß", "Ж", "中文", "ǅ", "ʰ", "1", "٣", "²", "Ⅻ", "½", "2024", ".", ",", "!?", "-",
          "'s", "'LL", '"', "(", "$", "€", "+", "🙂", "👩\u200d👩\u200d👧", "🏳\ufe0f\u200d🌈", "🇫🇷", "\u0301", "e\u0301",
          "\u093f", " ", "  ", "    ", "\t", "\n", "\n\n", "\r\n", "\r", "\x0b", "\x0c", "\x85", "\xa0", "\u2003", "\u3000",
          "\u2028", "\x1c", "\x00", "<|endoftext|>", "<s>", "\ud7ff", "\U0010ffff", "\uffff"]


def _texts(n: int, seed: int, pieces=PIECES) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randrange(0, 30))) for _ in range(n)]


def test_byte_level_round_trips_any_text(tokenizers):
    for name in BYTE_LEVEL:
        tokenizer = tokenizers[name]
        for text in _texts(300, 1) + ["", " ", "\r\n\r\n", "x" * 5000, "\U0001f469\u200d\U0001f4bb" * 50]:
            ids = tokenizer.encode(text, split_special_tokens=True)
            want = unicodedata.normalize("NFC", text) if name == "qwen2-style" else text  # Qwen2 normalizes to NFC
            assert tokenizer.decode(ids) == want, (name, text)


def test_sentencepiece_round_trips_any_text_but_the_meta_symbol(tokenizers):
    tokenizer = tokenizers["sentencepiece-style"]
    for text in _texts(300, 2) + ["", " ", "  x", "x" * 3000]:
        ids = tokenizer.encode(text, split_special_tokens=True)
        assert tokenizer.decode(ids) == text, text
        assert tokenizer.encode(text, add_special_tokens=True, split_special_tokens=True) == [1, *ids]


def test_every_letter_and_every_digit_is_one_word(tokenizers):
    every = "".join(map(chr, range(0x110000)))
    categories = list(map(unicodedata.category, every))
    letters = "".join(c for c, cat in zip(every, categories) if cat[0] == "L")
    digits = "".join(c for c, cat in zip(every, categories) if cat[0] == "N")
    gpt2, llama3, qwen2 = (tokenizers[n] for n in ("gpt2-style", "llama3-style", "qwen2-style"))
    assert gpt2.words(" " + letters, 2) == [" " + letters] and llama3.words(" " + letters, 2) == [" " + letters]
    assert gpt2.words(digits, 2) == [digits]
    assert llama3.words(digits, 2) == [digits[i: i + 3] for i in range(0, len(digits), 3)]
    assert qwen2.words(digits, 2) == list(digits)
    ids = gpt2.encode(letters[:3000])  # a long word: the heap merges it
    assert gpt2.decode(ids) == letters[:3000]


def test_whitespace_runs_crlf_and_empty_input(tokenizers):
    gpt2, llama3 = tokenizers["gpt2-style"], tokenizers["llama3-style"]
    assert gpt2.words("a   b\t\t\nc  ", 2) == ["a", "  ", " b", "\t\t", "\n", "c", "  "]
    assert llama3.words("a   b\r\n\r\n  c\n", 2) == ["a", "  ", " b", "\r\n\r\n", " ", " c", "\n"]
    assert llama3.words("x.\r\ny", 2) == ["x", ".\r\n", "y"]
    for tokenizer in tokenizers.values():
        assert tokenizer.encode("") == [] and tokenizer.decode([]) == ""
    assert llama3.encode("", add_special_tokens=True) == [llama3.token_to_id("<|begin_of_text|>")]


def test_the_heap_and_the_scan_merge_alike(tokenizers):
    rng = random.Random(3)
    for name in ("gpt2-style", "sentencepiece-style"):
        model = tokenizers[name].model
        alphabet = [t for t in model.vocab if len(t) == 1]
        for _ in range(400):
            symbols = model.symbols("".join(rng.choice(alphabet) for _ in range(rng.randrange(2, 40))))
            assert model._merge_by_scan(list(symbols)) == model.merge_by_heap(list(symbols))


def test_merges_in_both_file_forms_give_the_same_ids(tokenizers):
    for name, as_pairs in (("gpt2-style", True), ("llama3-style", False)):
        spec = _spec(name)
        merges = spec["model"]["merges"]
        spec["model"]["merges"] = [m.split(" ") for m in merges] if as_pairs else [" ".join(m) for m in merges]
        other = _build(spec)
        for text in _texts(100, 4):
            assert other.encode(text) == tokenizers[name].encode(text)


def _tiny(vocab: list[str], merges: list[str], **model) -> dict:
    return {"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": None, "post_processor": None,
            "decoder": None, "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(vocab)}, "merges": merges,
                                       **model}}


def test_ignore_merges_takes_a_whole_word_from_the_vocabulary():
    spec = _tiny(["a", "b", "c", "ab", "abc"], ["a b"])
    assert _build(spec).encode("abc") == [3, 2]
    spec["model"]["ignore_merges"] = True
    assert _build(spec).encode("abc") == [4] and _build(spec).encode("abca") == [3, 2, 0]


def test_byte_fallback_unknown_tokens_and_fuse_unk():
    vocab = ["<unk>", "a", *(f"<0x{b:02X}>" for b in range(256))]
    assert _build(_tiny(vocab, [], unk_token="<unk>", byte_fallback=True)).encode("aé") == [1, 2 + 0xC3, 2 + 0xA9]
    assert _build(_tiny(vocab, [], unk_token="<unk>")).encode("aéü a") == [1, 0, 0, 0, 1]
    assert _build(_tiny(vocab, [], unk_token="<unk>", fuse_unk=True)).encode("aéü a") == [1, 0, 1]
    assert _build(_tiny(vocab, [])).encode("aéa") == [1, 1]  # no unk_token: the character is dropped
    spec = _tiny(vocab, [], byte_fallback=True)
    spec["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]}
    assert _build(spec).decode([2 + 0xC3, 2 + 0xA9, 1, 2 + 0xC3, 2 + 0xC3, 1]) == "éa\ufffd\ufffda"  # one per byte


def test_added_token_options_and_normalized_tokens():
    spec = _tiny(["a", "b", " ", "x"], [])
    spec["normalizer"] = {"type": "Lowercase"}
    spec["added_tokens"] = [
        {"id": 4, "content": "<L>", "single_word": False, "lstrip": True, "rstrip": False, "normalized": False, "special": True},
        {"id": 5, "content": "<R>", "single_word": False, "lstrip": False, "rstrip": True, "normalized": False, "special": False},
        {"id": 6, "content": "ab", "single_word": True, "lstrip": False, "rstrip": False, "normalized": False, "special": False},
        {"id": 7, "content": "XB", "single_word": False, "lstrip": False, "rstrip": False, "normalized": True, "special": False}]
    tokenizer = _build(spec)
    assert tokenizer.encode("a  <L>b") == [0, 4, 1]  # lstrip takes the spaces before it
    assert tokenizer.encode("a<R>  b") == [0, 5, 1]  # rstrip the spaces after it
    assert tokenizer.encode("ab abx") == [6, 2, 0, 1, 3]  # single_word: not inside "abx"
    assert tokenizer.encode("xB") == [7] and tokenizer.decode([7]) == "xb"  # matched and decoded normalized
    assert tokenizer.encode("<L>", split_special_tokens=True) == []  # "<", "L", ">" are not in the vocabulary
    assert tokenizer.decode([0, 4, 5], skip_special_tokens=True) == "a <R>"  # no decoder: joined by spaces


def test_added_tokens_match_leftmost_longest():
    spec = _tiny(["a", "<", ">"], [])
    spec["added_tokens"] = [{"id": 3 + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, c in enumerate(["<a>", "<a>>", "a>"])]
    assert _build(spec).encode("<a>>a>") == [4, 5]  # "<a>>" (longest at the leftmost start), then "a>"
    assert _build(spec).encode("a<a>") == [0, 3]


def test_the_metaspace_spelling_agrees_with_the_legacy_one_except_where_it_should(tokenizers):
    legacy = tokenizers["sentencepiece-style"]
    spec = _spec("sentencepiece-style")
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    modern = _build(spec)
    for text in _texts(200, 5, [p for p in PIECES if p not in ("<s>", " ", "  ", "    ")]):
        if not text.startswith(" "):
            assert modern.encode(text) == legacy.encode(text), text
    tokens = lambda tokenizer, text: [tokenizer.model.id_to_token[i] for i in tokenizer.encode(text)]  # noqa: E731
    assert tokens(legacy, " Hi")[0] == "\u2581\u2581" and tokens(modern, " Hi")[0] == "\u2581H"  # "▁▁Hi" / "▁Hi"
    assert tokens(legacy, "<s>Hi") == ["<s>", "\u2581H", "i"] and tokens(modern, "<s>Hi") == ["<s>", "H", "i"]


def test_decoders(tokenizers):
    spec = _tiny(["\u2581a", "b"], [])
    spec["decoder"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}
    assert _build(spec).decode([0, 1, 0]) == "ab a"
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 1}]}
    assert _build(spec).decode([0, 1, 0]) == "ab a"
    assert tokenizers["gpt2-style"].decode([tokenizers["gpt2-style"].model.vocab["\u0120"]] * 2) == "  "


def test_the_chunk_cache_changes_no_ids(tokenizers):
    for name in BYTE_LEVEL:
        tokenizer = tokenizers[name]
        assert tokenizer.chunk_cache is not None
        plain = copy.copy(tokenizer)
        plain.chunk_cache = None
        for text in _texts(300, 6) + [(FIXTURES / name / f"cases/0{i}_{c}.txt").read_text() for i, c in
                                      ((1, "scripts"), (3, "whitespace"), (8, "code"))]:
            assert tokenizer.encode(text) == plain.encode(text), text


@pytest.mark.parametrize("name", [*BYTE_LEVEL, "sentencepiece-style"])
def test_segments_join_to_the_whole_texts_ids(tokenizers, name):
    tokenizer = tokenizers[name]
    cut = cut_pattern(tokenizer)
    assert cut is not None
    lines = [line for line in _texts(400, 7) if line.strip()]
    for newline in ("\n", "\r\n"):
        text = newline.join(lines)
        parts = segments(text, cut, target_chars=100)
        assert "".join(parts) == text and (len(parts) > 10 or name == "gpt2-style" and newline == "\r\n")
        joined = [i for k, part in enumerate(parts) for i in tokenizer.encode(part, continued=k > 0)]
        assert joined == tokenizer.encode(text)
    if name == "gpt2-style":  # "\s+(?!\S)" reads a final "\r\n" as one piece: no cut after "\r\n"
        assert len(segments("ab\r\ncd" * 100, cut, target_chars=10)) == 1


def test_a_prefix_space_is_not_added_in_front_of_a_continued_segment():
    spec = _spec("gpt2-style")
    spec["pre_tokenizer"]["add_prefix_space"] = True  # every piece gets " " in front, but not a cut-off part
    tokenizer = _build(spec)
    cut = cut_pattern(tokenizer)
    assert cut is not None and tokenizer.chunk_cache is None  # (the fast path needs no prefix)
    text = "\n".join(f"line {i} of text" for i in range(300))
    parts = segments(text, cut, target_chars=50)
    assert len(parts) > 20
    assert [i for k, p in enumerate(parts) for i in tokenizer.encode(p, continued=k > 0)] == tokenizer.encode(text)


def test_space_chunks_only_where_the_probes_allow_them():
    spec = _spec("gpt2-style")  # a split that keeps a word's trailing space with it, and a merge that uses it
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\S+\\s?|\\s+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    spec["model"]["vocab"]["a\u0120"] = 2000
    spec["model"]["merges"].insert(0, "a \u0120")
    tokenizer = _build(spec)
    assert tokenizer.words("ab cd  e", 2) == ["ab ", "cd ", " ", "e"]
    assert tokenizer.encode("a b") == [2000, tokenizer.model.vocab["b"]]  # "aĠ" "b"
    assert tokenizer.chunk_cache is None  # cutting before " b" would give "a" "Ġ" "b"
    del spec["model"]["vocab"]["a\u0120"], spec["model"]["merges"][0]
    assert _build(spec).chunk_cache is not None  # without such a merge the ids cannot change: allowed


def test_no_cut_when_an_added_token_holds_a_line_break():
    spec = _spec("gpt2-style")
    spec["added_tokens"].append({"id": 2000, "content": "a\nb", "single_word": False, "lstrip": False, "rstrip": False,
                                 "normalized": False, "special": True})
    assert cut_pattern(_build(spec)) is None


@pytest.mark.parametrize("edit, words", [
    (lambda s: s["model"].update(type="Unigram"), 'model type "Unigram" is not supported (supported: BPE)'),
    (lambda s: s.update(pre_tokenizer={"type": "Whitespace"}),
     'pre_tokenizer type "Whitespace" is not supported (supported: ByteLevel, Split, Sequence, Metaspace, Digits)'),
    (lambda s: s.update(normalizer={"type": "Sequence", "normalizers": [{"type": "BertNormalizer"}]}),
     'normalizer.normalizers[0] type "BertNormalizer" is not supported'),
    (lambda s: s.update(decoder={"type": "WordPiece"}), 'decoder type "WordPiece" is not supported'),
    (lambda s: s.update(post_processor={"type": "RobertaProcessing"}), 'post_processor type "RobertaProcessing"'),
    (lambda s: s["model"]["merges"].__setitem__(3, "a b c"), 'model.merges[3] must be "a b" or ["a", "b"]'),
    (lambda s: s["model"]["merges"].__setitem__(0, "Ġ zzz"), "model.merges[0] merge 'Ġ zzz' needs 'zzz'"),
    (lambda s: s["model"].update(dropout=0.1), "model.dropout must be null or 0"),
    (lambda s: s["model"].update(vocab=[]), "model.vocab must be an object"),
    (lambda s: s.update(pre_tokenizer={"type": "Split", "pattern": {"Regex": "\\p{Han}+"}, "behavior": "Isolated",
                                       "invert": False}), 'pre_tokenizer.pattern regex "\\p{Han}+": \\p{Han}: only general'),
    (lambda s: s.update(version="2.0"), "version '2.0' is not a known tokenizer.json version"),
    (lambda s: s.update(pre_tokenizer={"type": "Split", "pattern": {"String": "-"}, "behavior": "Merged", "invert": True}),
     "pre_tokenizer.behavior 'Merged' is not one of Isolated, Removed, MergedWithPrevious, MergedWithNext, Contiguous"),
    (lambda s: s.update(pre_tokenizer={"type": "Split", "pattern": {"String": "-"}, "behavior": "Removed", "invert": "yes"}),
     "pre_tokenizer.invert must be true or false, got 'yes'"),
])
def test_an_unsupported_or_malformed_structure_is_one_line_naming_the_field(tmp_path, edit, words):
    spec = _spec("gpt2-style")
    edit(spec)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError) as raised:
        load_tokenizer(tmp_path)
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'tokenizer.json'}: ") and words in message and "\n" not in message


def test_a_folder_without_tokenizer_json_or_with_broken_json(tmp_path):
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        load_tokenizer(tmp_path)
