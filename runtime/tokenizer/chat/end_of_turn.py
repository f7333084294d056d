"""The texts that end a turn in a model folder's chat template: what an SFT loss trains the model to write after
each answer (runtime/engine/data/chat_encoding.py) and where chat generation stops (run.py generate --chat).

They are the folder's end-of-sequence tokens: generation_config.json's ``eos_token_id`` (an id or a list: Llama
3.1 Instruct lists <|end_of_text|>, <|eom_id|> and <|eot_id|>), the tokenizer's eos_token, and the special tokens
the families' templates end a turn with, where the tokenizer has them as special tokens (a tokenizer-only folder
names no eos list: Llama 3's eos_token is <|end_of_text|>, while its template ends turns with <|eot_id|>).
"""

from __future__ import annotations

import os

from runtime.tokenizer.chat.errors import ChatTemplateError
from runtime.tokenizer.chat.template import ChatTemplate
from runtime.tokenizer.folder import generation_eos_ids
from runtime.tokenizer.tokenizer import Tokenizer

END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                      "</s>", "<|endoftext|>", "<|end_of_text|>")


def end_of_turn_markers(folder: str | os.PathLike, tokenizer: Tokenizer, template: ChatTemplate) -> tuple[str, ...]:
    """The texts of the folder's end-of-sequence ids, its eos_token and the families' end-of-turn specials the
    tokenizer has, in that order without repeats; ChatTemplateError when there is none."""
    texts = [tokenizer.decode([i]) for i in generation_eos_ids(folder)]
    eos = template.special_tokens.get("eos_token")
    texts += [eos] if isinstance(eos, str) else []
    texts += [t for t in END_OF_TURN_TOKENS if (i := tokenizer.token_to_id(t)) is not None and tokenizer.is_special(i)]
    markers = tuple(dict.fromkeys(t for t in texts if t))
    if not markers:
        raise ChatTemplateError(f"{folder}: no end-of-turn token found (generation_config.json eos_token_id, "
                                f"eos_token, or one of {', '.join(END_OF_TURN_TOKENS)})")
    return markers


def end_of_turn_ids(markers: tuple[str, ...], tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids of the markers that are single tokens (the ones generation can stop at)."""
    return tuple(dict.fromkeys(i for m in markers if (i := tokenizer.token_to_id(m)) is not None))
