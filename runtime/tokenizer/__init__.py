"""Tokenizers read from a Hugging Face folder's tokenizer.json, with the standard library only: byte-level
BPE (GPT-2, Llama 3, Qwen2/Qwen3, gpt-oss's o200k) and SentencePiece-style BPE (Llama 2, Mistral, Mixtral),
giving the ids and texts Hugging Face's tokenizers gives.

    unicode_classes.py  \\p{L}, \\p{N}, Oniguruma's \\s ... as code-point ranges from unicodedata
    regex.py            Oniguruma patterns -> Python re
    json_fields.py      reading tokenizer.json with one-line errors naming the field
    byte_level.py       GPT-2's byte <-> character alphabet
    normalizers.py pre_tokenizers.py bpe.py added_tokens.py post_processors.py decoders.py   the stages
    tokenizer.py        the stages assembled: encode / decode, the word cache
    segments.py         long texts cut where the ids cannot change
    folder.py           a folder: tokenizer.json, bos / eos, generation_config.json, copying the files
    token_spans.py      character spans -> token spans (an SFT loss's assistant tokens)
    chat/               chat templates (Jinja2's subset, rendered as transformers renders them)
"""

from runtime.tokenizer.folder import (
    TOKENIZER_FILES,
    SpecialIds,
    copy_tokenizer_files,
    generation_eos_ids,
    has_tokenizer,
    load_tokenizer,
    special_ids,
    tokenizer_files,
)
from runtime.tokenizer.json_fields import TokenizerError
from runtime.tokenizer.token_spans import char_spans_to_token_spans
from runtime.tokenizer.tokenizer import Tokenizer

__all__ = ["TOKENIZER_FILES", "SpecialIds", "Tokenizer", "TokenizerError", "char_spans_to_token_spans",
           "copy_tokenizer_files", "generation_eos_ids", "has_tokenizer", "load_tokenizer", "special_ids",
           "tokenizer_files"]
