"""A Hugging Face tokenizer folder: ``tokenizer.json`` (everything that makes ids) plus the names of the
beginning- and end-of-text tokens from ``tokenizer_config.json`` (or ``special_tokens_map.json``), and a
model folder's ``generation_config.json`` end-of-sequence ids. Read with ``json`` alone.

``truncation`` and ``padding`` in tokenizer.json are per-call settings (transformers passes its own), so
they are not applied; everything else either is read exactly or is a one-line TokenizerError.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from runtime.tokenizer.json_fields import Node, TokenizerError
from runtime.tokenizer.tokenizer import Tokenizer

TOKENIZER_JSON = "tokenizer.json"
# What a checkpoint and an export keep of a run's tokenizer folder; transformers 5 writes the chat template apart.
TOKENIZER_FILES = (TOKENIZER_JSON, "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class SpecialIds:
    bos: int | None
    eos: int | None


def has_tokenizer(folder: str | os.PathLike | None) -> bool:
    return folder is not None and (Path(folder) / TOKENIZER_JSON).is_file()


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """The folder's tokenizer.json; TokenizerError naming the file and field when it cannot be read exactly."""
    path = Path(folder) / TOKENIZER_JSON
    if not path.is_file():
        what = "not a folder" if not Path(folder).is_dir() else f"it has no {TOKENIZER_JSON}"
        raise TokenizerError(f"{folder}: {what} (a Hugging Face tokenizer folder holds {TOKENIZER_JSON})")
    node = Node.root(_read_json(path), str(path))
    version = node.get("version", str, "1.0")
    if version != "1.0":
        raise node.error(f"{version!r} is not a known tokenizer.json version (1.0)", "version")
    return Tokenizer(node)


def special_ids(folder: str | os.PathLike, tokenizer: Tokenizer) -> SpecialIds:
    """bos / eos ids named by tokenizer_config.json, else special_tokens_map.json (either may be absent)."""
    found: dict[str, int | None] = {"bos_token": None, "eos_token": None}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = Path(folder) / name
        if not path.is_file():
            continue
        config = _read_json(path)
        for key in found:
            value = config.get(key) if isinstance(config, dict) else None
            if found[key] is not None or value is None:
                continue
            content = value.get("content") if isinstance(value, dict) else value
            if not isinstance(content, str):
                raise TokenizerError(f"{path}: {key} must be a string or {{\"content\": ...}}, got {value!r}")
            token_id = tokenizer.token_to_id(content)
            if token_id is None:
                raise TokenizerError(f"{path}: {key} {content!r} is not a token of {TOKENIZER_JSON}")
            found[key] = token_id
    return SpecialIds(found["bos_token"], found["eos_token"])


def generation_eos_ids(folder: str | os.PathLike) -> list[int]:
    """``eos_token_id`` of a model folder's generation_config.json (an id or a list), else []."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return []
    config = _read_json(path)
    value = config.get("eos_token_id") if isinstance(config, dict) else None
    ids = value if isinstance(value, list) else [value] if value is not None else []
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TokenizerError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
    return ids


def tokenizer_files(folder: str | os.PathLike) -> dict[str, bytes]:
    """The tokenizer files ``folder`` has, by name."""
    return {name: (Path(folder) / name).read_bytes() for name in TOKENIZER_FILES if (Path(folder) / name).is_file()}


def copy_tokenizer_files(source: str | os.PathLike, destination: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files ``source`` has into ``destination``; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(destination) / name)
            copied.append(name)
    return copied


def _read_json(path: Path):
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
