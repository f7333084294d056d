"""``run.py generate --chat``: the conversation to answer, rendered as the model's chat template renders it for
generation (``add_generation_prompt``: the assistant's header ends the prompt), and the ids generation stops at.

The messages come from ``--messages FILE`` (a JSON list of {role, content} messages, or an object with
``messages`` and optionally ``tools``, as one line of chat data: runtime/engine/data/conversations.py) or from
``--user TEXT`` (repeatable; each a user message) or ``--prompt TEXT`` (one user message). The template writes
the special tokens itself (Llama 3's <|begin_of_text|>), so the text is encoded without the post-processor's.
Generation stops at the folder's end-of-turn ids (runtime/tokenizer/chat/end_of_turn.py: generation_config.json's
eos list first) as well as the codec's end-of-sequence ids.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from runtime.config import ConfigError
from runtime.engine.data.conversations import Conversation, conversation_of
from runtime.engine.data.corpus import DataError
from runtime.tokenizer import Tokenizer
from runtime.tokenizer.chat import ChatTemplate, ChatTemplateError
from runtime.tokenizer.chat.end_of_turn import end_of_turn_ids, end_of_turn_markers


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    stop_ids: tuple[int, ...]  # the end-of-turn ids
    text: str  # the rendered prompt


def wants_chat(args: argparse.Namespace) -> bool:
    return bool(args.chat or args.messages or args.user)


def conversation(args: argparse.Namespace) -> Conversation:
    """The messages ``--messages``, ``--user`` or ``--prompt`` give; ConfigError naming the flag otherwise."""
    if args.messages:
        path = Path(args.messages)
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"--messages {path}: not a readable JSON file ({e})") from None
        record = {"messages": record} if isinstance(record, list) else record
        where = f"--messages {path}"
    elif args.user or args.prompt is not None:
        record = {"messages": [{"role": "user", "content": text} for text in (args.user or [args.prompt])]}
        where = "--user" if args.user else "--prompt"
    else:
        raise ConfigError("--chat needs the conversation: --messages FILE, --user TEXT (repeatable) or --prompt TEXT")
    try:
        return conversation_of(record, where=where)
    except DataError as e:
        raise ConfigError(str(e)) from None


def chat_prompt(chat: Conversation, *, folder: str | Path, tokenizer: Tokenizer) -> ChatPrompt:
    """``chat`` rendered with ``folder``'s chat template and a generation prompt, encoded, with its stop ids."""
    try:
        template = ChatTemplate.from_folder(folder)
        text = template.render(chat.messages, tools=chat.tools, add_generation_prompt=True)
        stops = end_of_turn_ids(end_of_turn_markers(folder, tokenizer, template), tokenizer)
    except ChatTemplateError as e:
        raise ConfigError(f"--chat: {e}") from None
    ids = tokenizer.encode(text)
    if not ids:
        raise ConfigError(f"--chat: {chat.where} renders to no tokens")
    return ChatPrompt(ids, stops, text)
