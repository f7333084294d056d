"""Added tokens (tokenizer.json ``added_tokens``): matched in the text before anything else splits it.

As tokenizers' added_vocabulary.rs: ids are those of the model's vocabulary when the content is in it,
else numbered from the vocabulary's size in file order. Tokens with ``normalized: false`` are found in the
raw text first; every piece between them is normalized, then split again by the ``normalized: true``
tokens (whose normalized form is what is matched, and what they decode to). Matching is leftmost-longest;
``single_word`` needs no word character (Rust regex ``\\w``: Alphabetic, marks, Nd, Pc, joiners) on either
side, ``lstrip`` / ``rstrip`` take the White_Space next to the token into it. ``split_special`` leaves
special tokens as plain text (tokenizers' ``encode_special_tokens``; tiktoken's ``encode_ordinary``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime.tokenizer import unicode_classes as uc
from runtime.tokenizer.json_fields import Node
from runtime.tokenizer.normalizers import Normalizer
from runtime.tokenizer.pre_tokenizers import CONTINUED, MIDDLE, START

# Rust's \w is Alphabetic + M + Nd + Pc + Join_Control. Alphabetic = L + Nl + Other_Alphabetic, whose
# members outside M are the circled and squared Latin letters (So).
_OTHER_ALPHABETIC_SYMBOLS = ((0x24B6, 0x24E9), (0x1F130, 0x1F149), (0x1F150, 0x1F169), (0x1F170, 0x1F189))


@dataclass(frozen=True)
class AddedToken:
    content: str
    single_word: bool = False
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = True
    special: bool = False


Split = tuple[str, int | None, int]  # (text, the added token's id or None, where: pre_tokenizers.START ...)


class AddedVocabulary:
    def __init__(self, tokens: list[AddedToken], *, model_vocab: dict[str, int], normalizer: Normalizer | None):
        self.ids: dict[str, int] = {}
        self.tokens: dict[int, AddedToken] = {}
        self.normalized_form: dict[int, str] = {}
        next_id = len(model_vocab)
        for token in tokens:
            if not token.content or self.tokens.get(self.ids.get(token.content, -1)) == token:
                continue
            token_id = self.ids.get(token.content, model_vocab.get(token.content))
            if token_id is None:
                token_id, next_id = next_id, next_id + 1
            if token.normalized and normalizer is not None and normalizer(token.content) != token.content:
                self.normalized_form[token_id] = normalizer(token.content)
            self.ids[token.content] = token_id
            self.tokens[token_id] = token
        self.special_contents = {t.content for t in self.tokens.values() if t.special}
        self._raw = _matcher({t.content: i for i, t in self.tokens.items() if not t.normalized})
        self._normalized = _matcher({self.normalized_form.get(i, t.content): i for i, t in self.tokens.items()
                                     if t.normalized})
        word = uc.union(uc.property_ranges("L"), uc.property_ranges("Nl"), uc.property_ranges("M"),
                        uc.property_ranges("Nd"), uc.property_ranges("Pc"), ((0x200C, 0x200D),), _OTHER_ALPHABETIC_SYMBOLS)
        self._word = re.compile(uc.char_class(word))
        space = uc.char_class(uc.white_space())
        self._space_at_end, self._space_at_start = re.compile(space + "*$"), re.compile(space + "*")

    @classmethod
    def from_json(cls, node: Node, *, model_vocab: dict[str, int], normalizer: Normalizer | None) -> AddedVocabulary:
        tokens = []
        for item in node.items("added_tokens") if node.value.get("added_tokens") is not None else []:
            tokens.append(AddedToken(item.get("content", str), item.get("single_word", bool, False),
                                     item.get("lstrip", bool, False), item.get("rstrip", bool, False),
                                     item.get("normalized", bool, True), item.get("special", bool, False)))
        return cls(tokens, model_vocab=model_vocab, normalizer=normalizer)

    def token(self, token_id: int) -> str | None:
        """The text an added token's id decodes to (its normalized form when normalizing changed it)."""
        if token_id not in self.tokens:
            return None
        return self.normalized_form.get(token_id, self.tokens[token_id].content)

    def split(self, text: str, normalizer: Normalizer | None, *, split_special: bool = False, where: int = START,
              continued_normalizer: Normalizer | None = None) -> list[Split]:
        """tokenizers' ``extract_and_normalize``: the text as added tokens and normalized pieces between them.
        ``where``: the first piece's place (START, or CONTINUED for a segment of a longer text, which
        ``continued_normalizer`` normalizes: no Prepend in front of it)."""
        out: list[Split] = []
        for s, e, token_id in self._find(text, self._raw, split_special):
            piece = text[s:e]
            place = where if s == 0 else MIDDLE
            if token_id is not None:
                out.append((piece, token_id, place))
                continue
            normalize = continued_normalizer if place == CONTINUED else normalizer
            normalized = normalize(piece) if normalize else piece
            for ns, ne, nid in self._find(normalized, self._normalized, split_special):
                if ne > ns:
                    out.append((normalized[ns:ne], nid, place if ns == 0 else MIDDLE))
        return out

    def _find(self, sentence: str, matcher, split_special: bool) -> list[tuple[int, int, int | None]]:
        """added_vocabulary.rs ``find_matches``: (start, end, id or None) covering ``sentence``."""
        if matcher is None or not sentence:
            return [(0, len(sentence), None)] if sentence else []
        regex, ids = matcher
        spans, offset = [], 0
        for m in regex.finditer(sentence):
            start, stop = m.span()
            token_id = ids[m.group()]
            token = self.tokens[token_id]
            if split_special and token.content in self.special_contents:
                continue
            if token.single_word:
                free_before = start == 0 or not self._word.fullmatch(sentence[start - 1])
                free_after = stop == len(sentence) or not self._word.fullmatch(sentence[stop])
                if not (free_before and free_after):
                    continue
            if token.lstrip:
                start = max(self._space_at_end.search(sentence, 0, start).start(), offset)
            if token.rstrip:
                stop = self._space_at_start.match(sentence, stop).end()
            if offset < start:
                spans.append((offset, start, None))
            spans.append((start, stop, token_id))
            offset = stop
        if offset != len(sentence):
            spans.append((offset, len(sentence), None))
        return spans


def _matcher(patterns: dict[str, int]):
    """Leftmost-longest over ``patterns``: a regex alternation, longest first (Python takes the first
    alternative that matches at the leftmost position)."""
    if not patterns:
        return None
    ordered = sorted(patterns, key=lambda p: (-len(p), p))
    return re.compile("|".join(map(re.escape, ordered))), patterns
