"""Chat data as JSON lines: one conversation per line, read and checked, each message kept as given.

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...], "tools": [...]}
    {"prompt": "...", "completion": "..."}          # a user turn and the assistant's answer

``messages`` is the list transformers' ``apply_chat_template`` takes (extra keys such as ``tool_calls``,
``tool_call_id`` or ``name`` pass through to the template); ``tools`` (optional) a list of JSON-schema
objects. ``prompt`` and ``completion`` may also be lists of messages (TRL's conversational prompt-completion
form). Blank lines are skipped. Anything else is a DataError naming the file and the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from runtime.engine.data.corpus import DataError

ROLES = ("system", "user", "assistant", "tool")
CHAT_KEYS = ("messages", "prompt")  # a record holding either is a conversation (detect.py sniffs for them)


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    tools: list[dict] | None
    where: str  # "FILE:LINE", for messages


def read_conversations(path: Path) -> Iterator[tuple[Conversation, int]]:
    """Each conversation of a JSON-lines file, with the bytes of its line (for progress)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 (invalid byte at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            yield conversation_of(record, where=where), len(raw)


def conversation_of(record: object, *, where: str) -> Conversation:
    """A record -> a checked Conversation; DataError naming ``where`` otherwise."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with \"messages\" (or \"prompt\" and \"completion\"), got "
                        f"{type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: \"messages\" must be a non-empty list of {{role, content}} objects")
    elif "prompt" in record and "completion" in record:
        messages = [*_turns(record["prompt"], "user", "prompt", where), *_turns(record["completion"], "assistant",
                                                                                 "completion", where)]
    else:
        raise DataError(f"{where}: a line without messages: give {{\"messages\": [...]}} or {{\"prompt\": ..., "
                        f"\"completion\": ...}} (keys found: {', '.join(map(repr, record)) or 'none'})")
    for i, message in enumerate(messages):
        _check_message(message, f"{where}: message {i}")
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: \"tools\" must be a list of JSON objects (function schemas)")
    return Conversation(messages, tools, where)


def _turns(value: object, role: str, key: str, where: str) -> list[dict]:
    """A prompt or completion: text (one message of ``role``) or a list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value:
        return value
    raise DataError(f"{where}: \"{key}\" must be text or a non-empty list of messages, got {type(value).__name__}")


def _check_message(message: object, where: str) -> None:
    if not isinstance(message, dict):
        raise DataError(f"{where}: expected a {{role, content}} object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise DataError(f"{where}: unknown role {role!r} (valid: {', '.join(ROLES)})")
    content = message.get("content")
    calls_tools = role == "assistant" and bool(message.get("tool_calls"))
    if not (isinstance(content, str) or (content is None and calls_tools)):
        raise DataError(f"{where}: \"content\" must be text" + (" (or null with tool_calls)" if role == "assistant"
                                                                else "") + f", got {type(content).__name__}")


def looks_like_chat(path: Path) -> bool:
    """Whether a JSON-lines file's first record is a conversation (``messages``, or ``prompt``)."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    record = json.loads(raw)
                    return isinstance(record, dict) and any(key in record for key in CHAT_KEYS)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return False


def not_chat_data(path: Path, *, flag: str) -> DataError:
    """Why a JSON-lines file whose first record is no conversation (``looks_like_chat`` false) cannot be read as chat
    data: that record's problem, naming the file and line, or that the file holds no record at all."""
    try:
        next(read_conversations(path), None)
    except DataError as e:
        return e
    return DataError(f"{flag} {path}: no conversations in it (empty, or blank lines only); chat data is one "
                     f"{{\"messages\": [...]}} object per line")
