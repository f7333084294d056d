"""A Hugging Face chat template, rendered as transformers' ``apply_chat_template(..., tokenize=False)`` renders it,
and the character spans of each assistant message's trained text.

The template is parsed and compiled once; a render runs the compiled closures over a fresh scope holding the
special tokens (bos_token, eos_token... from tokenizer_config.json), ``messages``, ``tools``, ``documents``,
``add_generation_prompt`` and any extra keyword arguments, above the globals transformers' environment has
(``raise_exception``, ``strftime_now``, ``range``, ``dict``, ``namespace``).
"""

from __future__ import annotations

import json
import os
from collections import abc
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from runtime.tokenizer.chat import nodes as n
from runtime.tokenizer.chat.errors import ChatTemplateError, RaisedByTemplate
from runtime.tokenizer.chat.evaluator import Scope
from runtime.tokenizer.chat.filters import FILTERS
from runtime.tokenizer.chat.parser import parse
from runtime.tokenizer.chat.predicates import TESTS
from runtime.tokenizer.chat.renderer import RenderState, compile_body
from runtime.tokenizer.chat.values import Namespace, safe_range

TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES = "additional_chat_templates"  # transformers saves named templates as <name>.jinja here
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _raise_exception(message: Any):
    raise RaisedByTemplate(str(message))


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


_GLOBALS = Scope({"range": safe_range, "dict": dict, "namespace": Namespace, "raise_exception": _raise_exception,
                  "strftime_now": _strftime_now})


@dataclass(frozen=True)
class ChatRendering:
    text: str
    assistant_spans: list[tuple[int, int]]  # [start, end) character offsets into text, one per assistant turn


class ChatTemplate:
    def __init__(self, source: str, *, special_tokens: dict[str, Any] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        body = parse(source, filters=set(FILTERS), tests=set(TESTS))
        self.has_generation_blocks = any(isinstance(node, n.Generation) for s in body for node in s.walk())
        self._run = compile_body(body)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, *, name: str | None = None) -> ChatTemplate:
        """The folder's template: ``chat_template.jinja``, else tokenizer_config.json's ``chat_template`` (a string,
        or a list of {name, template} from which ``name`` picks, "default" unless given); the special tokens
        from tokenizer_config.json, else special_tokens_map.json."""
        folder = Path(folder)
        config = _read_json(folder / "tokenizer_config.json")
        special = _special_tokens(config, folder / "tokenizer_config.json")
        for key, value in _special_tokens(_read_json(folder / "special_tokens_map.json"),
                                          folder / "special_tokens_map.json").items():
            special.setdefault(key, value)
        return cls(_template_source(folder, config, name), special_tokens=special)

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = False,
               **kwargs: Any) -> str:
        return self._render(messages, tools=tools, add_generation_prompt=add_generation_prompt, kwargs=kwargs)[0]

    def _render(self, messages: list[dict], *, tools: list[dict] | None, add_generation_prompt: bool,
                kwargs: dict[str, Any], track_generation: bool = False) -> tuple[str, list[tuple[int, int]]]:
        if not isinstance(messages, abc.Sequence) or isinstance(messages, str):
            raise ChatTemplateError(f"messages must be a list of {{role, content}} dicts, got {type(messages).__name__}")
        context = {**self.special_tokens, "messages": messages, "tools": tools, "documents": None,
                   "add_generation_prompt": add_generation_prompt, **kwargs}
        out: list[str] = []
        state = RenderState(out, track_generation=track_generation)
        self._run(Scope(context, _GLOBALS, state), out)
        return "".join(out), state.generation_spans

    def render_with_assistant_spans(self, messages: list[dict], *, end_markers: tuple[str, ...] = (),
                                    tools: list[dict] | None = None, add_generation_prompt: bool = False,
                                    **kwargs: Any) -> ChatRendering:
        """The rendered text and each assistant message's span in it. A template with ``{% generation %}``
        blocks gives their spans (transformers' assistant mask). Otherwise, for assistant message i, the span
        starts at len(render(messages[:i], add_generation_prompt=True)) (the role header stays prompt) and ends
        after the last of ``end_markers`` (the end-of-turn tokens, e.g. ``<|eot_id|>``) in
        render(messages[:i + 1]); both renders must be prefixes of the whole text."""
        if self.has_generation_blocks:
            text, spans = self._render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                       kwargs=kwargs, track_generation=True)
            return ChatRendering(text, spans)
        if not end_markers or not all(isinstance(m, str) and m for m in end_markers):
            raise ChatTemplateError(f"end_markers must name the end-of-turn texts (e.g. ('<|eot_id|>',)), got {end_markers!r}")
        text = self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        spans = []
        for i, message in enumerate(messages):
            if not (isinstance(message, abc.Mapping) and message.get("role") == "assistant"):
                continue
            prompt = self.render(messages[:i], tools=tools, add_generation_prompt=True, **kwargs)
            turn = self.render(messages[: i + 1], tools=tools, add_generation_prompt=False, **kwargs)
            for what, prefix in ((f"messages[:{i}] with the generation prompt", prompt), (f"messages[:{i + 1}]", turn)):
                if not text.startswith(prefix):
                    raise ChatTemplateError(f"assistant message {i}: {what} does not render to a prefix of the whole "
                                            "conversation, so its span cannot be found by rendering prefixes")
            ends = [turn.rfind(marker) + len(marker) for marker in end_markers if marker in turn]
            start, end = len(prompt), max(ends, default=-1)
            if end <= start:
                raise ChatTemplateError(f"assistant message {i}: no end-of-turn marker {list(end_markers)} after its "
                                        f"start (character {start})")
            spans.append((start, end))
        return ChatRendering(text, spans)

    def assistant_spans(self, messages: list[dict], *, end_markers: tuple[str, ...] = (),
                        tools: list[dict] | None = None, **kwargs: Any) -> list[tuple[int, int]]:
        """[start, end) character spans of each assistant message's trained text (render_with_assistant_spans)."""
        return self.render_with_assistant_spans(messages, end_markers=end_markers, tools=tools, **kwargs).assistant_spans


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ChatTemplateError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ChatTemplateError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _special_tokens(config: dict, path: Path) -> dict[str, Any]:
    """Token names as the template sees them: strings, or {"content": ...} objects read as their content."""
    found: dict[str, Any] = {}
    for key in (*SPECIAL_TOKENS, "additional_special_tokens"):
        value = config.get(key)
        if value is None:
            continue
        values = value if key == "additional_special_tokens" else [value]
        if not isinstance(values, list):
            raise ChatTemplateError(f"{path}: {key} must be a list of tokens, got {value!r}")
        contents = [v.get("content") if isinstance(v, dict) else v for v in values]
        if not all(isinstance(c, str) for c in contents):
            raise ChatTemplateError(f"{path}: {key} must be a string or {{\"content\": ...}}, got {value!r}")
        found[key] = contents if key == "additional_special_tokens" else contents[0]
    return found


def _template_source(folder: Path, config: dict, name: str | None) -> str:
    if name not in (None, "default"):
        named = folder / NAMED_TEMPLATES / f"{name}.jinja"
        if named.is_file():
            return named.read_text(encoding="utf-8")
    elif (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    where = folder / "tokenizer_config.json"
    if template is None:
        raise ChatTemplateError(f"{folder}: no chat template (neither {TEMPLATE_FILE} nor chat_template in "
                                "tokenizer_config.json)" if name in (None, "default") else
                                f"{folder}: no chat template named {name!r}")
    if isinstance(template, str):
        if name not in (None, "default"):
            raise ChatTemplateError(f"{where}: chat_template is a single template, there is none named {name!r}")
        return template
    if not (isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                               and isinstance(t.get("template"), str) for t in template)):
        raise ChatTemplateError(f"{where}: chat_template must be a string or a list of {{name, template}} objects")
    by_name = {t["name"]: t["template"] for t in template}
    wanted = name or "default"
    if wanted not in by_name:
        raise ChatTemplateError(f"{where}: chat_template has no template named {wanted!r} "
                                f"(it has {', '.join(map(repr, by_name))}); pass name=")
    return by_name[wanted]
