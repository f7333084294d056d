"""A tokenizer.json, assembled: text -> ids and ids -> text, as Hugging Face's tokenizers computes them.

    encode: added tokens split the text (added_tokens.py) -> each piece between them is normalized and
            pre-tokenized into words (normalizers.py, pre_tokenizers.py) -> each word's ids (bpe.py)
            -> with add_special_tokens, the post-processor's ids around them (post_processors.py)
    decode: ids -> token strings (added tokens first, special ones dropped on request) -> decoder chain

Speed: a word's ids are cached (``WordCache``: a dict whose misses run BPE), so a word seen before costs
one dict lookup; when the pre-tokenizer is one regex split whose matches are the words (GPT-2, Llama 3,
Qwen2, gpt-oss) a piece's words are one ``findall`` and the ids one ``chain(map(cache.__getitem__, words))``,
both in C. Above that, when the tokenizer passes segments.py's probes, a piece is cut before every space
between two non-spaces (``str.split``, no regex) and each " word," chunk's ids are cached too: most chunks
of English text are then one lookup, and the regex runs only on chunks not seen before (twice the speed).
A SentencePiece-style model without a pre-tokenizer runs BPE over whole pieces; when no vocabulary token has
"▁" after another character, a piece is cut before each such "▁" first (no merge can cross there), so its
words cache too.
"""

from __future__ import annotations

import re
from itertools import chain
from typing import Callable

from runtime.tokenizer import byte_level
from runtime.tokenizer.added_tokens import AddedVocabulary
from runtime.tokenizer.bpe import BPE
from runtime.tokenizer.decoders import build_decoder
from runtime.tokenizer.json_fields import Node
from runtime.tokenizer.normalizers import Normalizer, build_normalizer
from runtime.tokenizer.post_processors import PostProcessor, build_post_processor
from runtime.tokenizer.pre_tokenizers import CONTINUED, MIDDLE, START, PreTokenizer, build_pre_tokenizer
from runtime.tokenizer.segments import space_chunks, space_cuts_are_exact

MODELS = ("BPE",)
WORD_CACHE_ENTRIES = 1 << 17  # ~30 MB per cache and process at most
METASPACE = "\u2581"  # ▁


class WordCache(dict):
    """word -> tuple of ids; a miss computes them (and keeps them while there is room)."""

    def __init__(self, compute: Callable[[str], list[int]], capacity: int = WORD_CACHE_ENTRIES):
        super().__init__()
        self.compute, self.capacity = compute, capacity

    def __missing__(self, word: str) -> tuple[int, ...]:
        ids = tuple(self.compute(word))
        if len(self) < self.capacity:
            self[word] = ids
        return ids


class Tokenizer:
    def __init__(self, node: Node):
        model_node = node.child("model")
        model_node.type_of(MODELS)
        self.model = BPE.from_json(model_node)
        self.normalizer: Normalizer | None = build_normalizer(node.child("normalizer"))
        self.continued_normalizer = build_normalizer(node.child("normalizer"), prepend=False)
        self.pre_tokenizer: PreTokenizer = build_pre_tokenizer(node.child("pre_tokenizer"))
        self.added = AddedVocabulary.from_json(node, model_vocab=self.model.vocab, normalizer=self.normalizer)
        self.post_processor: PostProcessor = build_post_processor(node.child("post_processor"))
        self.decoder = build_decoder(node.child("decoder"))
        self.vocab_size = 1 + max([*self.model.id_to_token, *self.added.tokens], default=-1)
        for token_id in (*self.post_processor.prefix, *self.post_processor.suffix):
            if token_id >= self.vocab_size:
                raise node.child("post_processor").error(f"adds token id {token_id}, past the vocabulary ({self.vocab_size})")
        byte_words = self.pre_tokenizer.byte_level_words
        compute = (lambda w: self.model.tokenize(byte_level.to_byte_chars(w))) if byte_words else self.model.tokenize
        self.cache = WordCache(compute)
        self._fast_regex = self.pre_tokenizer.words_regex
        self._metaspace_words = (not byte_words and METASPACE in self.model.vocab
                                 and not self.model.continuing_subword_prefix and not self.model.end_of_word_suffix
                                 and not any(re.search(f"[^{METASPACE}]{METASPACE}", t) for t in self.model.vocab))
        self._metaspace_split = re.compile(f"{METASPACE}+[^{METASPACE}]*|[^{METASPACE}]+")
        self.chunk_cache: WordCache | None = None  # chunk (" " + key) -> ids
        if self._fast_regex is not None and space_cuts_are_exact(self):
            self.chunk_cache = WordCache(lambda key: self._piece_ids(" " + key, MIDDLE))

    # ---- encoding ----

    def encode(self, text: str, *, add_special_tokens: bool = False, split_special_tokens: bool = False,
               continued: bool = False) -> list[int]:
        """The ids of ``text``. ``split_special_tokens``: special-token text is plain text (a corpus that
        mentions "<|endoftext|>" keeps it as characters). ``continued``: ``text`` continues a document cut
        off before it (segments.py), so nothing that marks a text's start (Prepend, a prefix space) is added."""
        ids: list[int] = []
        where = CONTINUED if continued else START
        for piece, token_id, place in self.added.split(text, self.normalizer, split_special=split_special_tokens,
                                                       where=where, continued_normalizer=self.continued_normalizer):
            if token_id is not None:
                ids.append(token_id)
            elif self.chunk_cache is not None:
                first, *rest = space_chunks(piece)
                ids.extend(self._piece_ids(first, place) if first else ())
                ids.extend(chain.from_iterable(map(self.chunk_cache.__getitem__, rest)))
            else:
                ids.extend(self._piece_ids(piece, place))
        return self.post_processor.apply(ids) if add_special_tokens else ids

    def _piece_ids(self, piece: str, where: int) -> list[int]:
        return list(chain.from_iterable(map(self.cache.__getitem__, self.words(piece, where))))

    def words(self, piece: str, where: int) -> list[str]:
        """The pre-tokenized words of one normalized piece (before any byte-level mapping)."""
        if self._fast_regex is not None:
            words = self._fast_regex.findall(piece)
            # The matches cover the piece (no gaps to keep or drop) and none is empty (regex.find_spans: then
            # re iterates as Oniguruma does); else the exact split below.
            if sum(map(len, words)) == len(piece) and "" not in words:
                return words
        words = self.pre_tokenizer.words(piece, where)
        if self._metaspace_words:
            return [part for word in words for part in self._metaspace_split.findall(word)]
        return words

    # ---- decoding ----

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        tokens = []
        for token_id in ids:
            token = self.added.token(token_id)
            if token is None:
                token = self.model.id_to_token.get(token_id)
            if token is None or (skip_special_tokens and token in self.added.special_contents):
                continue  # an id in neither vocabulary decodes to nothing, as in tokenizers
            tokens.append(token)
        return self.decoder(tokens)

    def token_to_id(self, token: str) -> int | None:
        found = self.added.ids.get(token)
        return found if found is not None else self.model.vocab.get(token)

    def is_special(self, token_id: int) -> bool:
        token = self.added.tokens.get(token_id)
        return token is not None and token.special
