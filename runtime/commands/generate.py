"""``python run.py generate``: continue a prompt with a trained or pretrained model, in one process.

    python run.py generate --checkpoint ckpt --prompt "The Python " --max-new-tokens 80
    python run.py generate --init-from gpt2-folder --prompt-ids 464,11361,3303 --max-new-tokens 20 --temperature 0
    python run.py generate --init-from ~/models/Qwen3-0.6B --chat --user "Name three rivers." --temperature 0

The model comes from a checkpoint (its latest complete one, or a ``step-N`` folder; read whole in this
process, like ``export``) or a Hugging Face folder of either family (``--init-from``, as training reads
it). The prompt runs once, then each new token is one forward of one position over a KV cache
(models/generation.py). ``--temperature 0`` is greedy; otherwise tokens are drawn from the softmax of
logits / temperature over the ``--top-k`` most likely, with ``--seed``.

With a tokenizer (the ``--init-from`` folder's or the checkpoint's tokenizer.json, or ``--tokenizer FOLDER``)
``--prompt TEXT`` is encoded as Hugging Face encodes it (with the post-processor's bos, e.g. Llama 3's
<|begin_of_text|>), generation stops at an end-of-sequence id (generation_config.json's ``eos_token_id``
and the tokenizer's eos_token) and the text is printed. Byte-level models (a vocabulary of 256: the
UTF-8 bytes are the tokens, as the built-in data is) need no tokenizer. Otherwise ``--prompt-ids`` gives
token ids and ids are printed. The last line printed is one JSON object: ``prompt_ids``, ``new_ids`` and,
with text, ``text`` (the new tokens decoded) and ``stopped`` ("eos" or "length").

``--chat`` (or ``--messages FILE`` / ``--user TEXT``) renders a conversation with the folder's chat template and
a generation prompt, stops at its end-of-turn ids and prints the answer alone (runtime/commands/chat_prompt.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from compiler.lora import LoraConfig, merged_weights
from models import MTP, config_from_dict, generate, spec_of, without_mtp
from runtime.checkpoint.files import CheckpointError, verify_files
from runtime.checkpoint.hf_weights import check_weights, position_limit, read_hf_model, read_state_dict
from runtime.checkpoint.weights import load_model_weights, resolve_checkpoint
from runtime.commands.chat_prompt import chat_prompt, conversation, wants_chat
from runtime.commands.flags import HelpFormatter
from runtime.config import ConfigError
from runtime.device import select_device
from runtime.tokenizer import Tokenizer, TokenizerError, generation_eos_ids, has_tokenizer, load_tokenizer, special_ids

BYTE_VOCABULARY = 256


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(f"{message} (see run.py generate --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="run.py generate", formatter_class=HelpFormatter, description=(
        "Continue a prompt with a trained (--checkpoint) or pretrained (--init-from) model, in one process, with a "
        "KV cache. With a tokenizer (the folder's or checkpoint's tokenizer.json, or --tokenizer) and for byte-level "
        "models (vocabulary 256), --prompt takes text and text is printed, up to an end-of-sequence token; "
        "otherwise --prompt-ids takes token ids and ids are printed. The last line printed is JSON: prompt_ids, "
        "new_ids and, with text, text (the new tokens decoded) and stopped (eos or length)."))
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR",
                        help="a checkpoint folder (DIR/step-N) or a checkpoint directory (its latest complete one)")
    source.add_argument("--init-from", metavar="FOLDER", help="a Hugging Face model folder (its config.json names the family)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT",
                        help="text: encoded by the tokenizer (with its bos), or as UTF-8 bytes for byte-level models")
    prompt.add_argument("--prompt-ids", metavar="IDS",
                        help="comma-separated token ids, e.g. 464,11361 (from the model's tokenizer)")
    prompt.add_argument("--messages", metavar="FILE",
                        help="a conversation to answer (implies --chat): a JSON list of {role, content} messages, or "
                             "{\"messages\": [...], \"tools\": [...]}")
    prompt.add_argument("--user", action="append", metavar="TEXT",
                        help="a user message to answer (implies --chat; repeat for several)")
    p.add_argument("--chat", action="store_true",
                   help="render the conversation (--messages, --user, or --prompt as one user message) with the "
                        "tokenizer folder's chat template and a generation prompt; stop at its end-of-turn ids "
                        "(generation_config.json's eos list, the tokenizer's end-of-turn tokens); print the answer")
    p.add_argument("--tokenizer", metavar="FOLDER",
                   help="a Hugging Face tokenizer folder (default: the --init-from folder's or the checkpoint's "
                        "tokenizer.json, when there is one)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (at most)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy (argmax)")
    p.add_argument("--top-k", type=int, help="sample among the K most likely tokens only (default: all of them)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the sampling")
    return p


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        _check_numbers(args)
        source = model_source(args)
        text = TextCodec.of(args, source)
        if wants_chat(args):
            text, prompt = _chat(args, source, text)
        else:
            prompt = prompt_ids(args, vocab_size=source.config.vocab_size, codec=text)
        _check_length(len(prompt), args.max_new_tokens, limit=position_limit(source.config))
        state = source.read()
    except (ConfigError, CheckpointError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg, device = source.config, select_device(0)
    model = build(cfg, state).to(device)
    print(f"{cfg.family} model, {sum(p.numel() for p in model.parameters()):,} parameters, from {source}; "
          f"{len(prompt)} prompt tokens" + (f", {text}" if text else "") + f", on {device}", file=sys.stderr, flush=True)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    start = time.perf_counter()
    new = generate(model, torch.tensor([prompt], device=device), n_layers=cfg.n_layers,
                   max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   generator=generator, stop_ids=text.stop_ids if text else ())[0].tolist()
    seconds = time.perf_counter() - start
    print(f"{len(new)} tokens in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s)", file=sys.stderr)
    result: dict[str, Any] = {"prompt_ids": prompt, "new_ids": new}
    if text:
        whole, continuation = text.decode(prompt, new)
        result.update(text=continuation, stopped="eos" if new[-1] in text.stop_ids else "length")
        print(continuation if wants_chat(args) else whole)
    else:
        print(" ".join(str(i) for i in new))
    print(json.dumps(result), flush=True)
    return 0


def _chat(args: argparse.Namespace, source: ModelSource, codec: TextCodec | None) -> tuple[TextCodec, list[int]]:
    """The chat prompt's ids, and the codec stopping at the end-of-turn ids too."""
    folder = args.tokenizer or source.folder
    if codec is None or codec.tokenizer is None or folder is None:
        raise ConfigError("--chat needs the model's tokenizer folder with a chat template (--tokenizer FOLDER)")
    chat = chat_prompt(conversation(args), folder=folder, tokenizer=codec.tokenizer)
    return dataclasses.replace(codec, stop_ids=tuple(dict.fromkeys([*chat.stop_ids, *codec.stop_ids]))), chat.ids


@dataclass(frozen=True)
class TextCodec:
    """Text <-> ids for a model: its tokenizer, or UTF-8 bytes for a byte-level vocabulary."""

    tokenizer: Tokenizer | None  # None: bytes
    stop_ids: tuple[int, ...]
    where: str

    @classmethod
    def of(cls, args: argparse.Namespace, source: ModelSource) -> TextCodec | None:
        folder = args.tokenizer or next((f for f in (source.folder,) if has_tokenizer(f)), None)
        if folder is None:
            return cls(None, (), "bytes") if source.config.vocab_size == BYTE_VOCABULARY else None
        tokenizer = load_tokenizer(folder)
        if tokenizer.vocab_size > source.config.vocab_size:
            raise ConfigError(f"the tokenizer in {folder} has {tokenizer.vocab_size:,} tokens, more than this model's "
                              f"vocabulary ({source.config.vocab_size:,}): not this model's tokenizer")
        eos = special_ids(folder, tokenizer).eos
        stops = generation_eos_ids(source.folder) if source.folder else []
        return cls(tokenizer, tuple(dict.fromkeys([*stops, *([eos] if eos is not None else [])])), f"the tokenizer of {folder}")

    def __str__(self) -> str:
        return self.where

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8")) if self.tokenizer is None else self.tokenizer.encode(text, add_special_tokens=True)

    def decode(self, prompt: list[int], new: list[int]) -> tuple[str, str]:
        """(the prompt and continuation as text, the continuation alone), without the end-of-sequence id. The
        continuation is cut from the whole text: decoders such as SentencePiece's drop a leading space."""
        if new and new[-1] in self.stop_ids:
            new = new[:-1]
        if self.tokenizer is None:
            return bytes(prompt + new).decode("utf-8", errors="replace"), bytes(new).decode("utf-8", errors="replace")
        whole = self.tokenizer.decode(prompt + new, skip_special_tokens=True)
        before = self.tokenizer.decode(prompt, skip_special_tokens=True)
        return whole, whole[len(before):] if whole.startswith(before) else self.tokenizer.decode(new, skip_special_tokens=True)


def _check_numbers(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {args.top_k}")


@dataclass(frozen=True)
class ModelSource:
    config: Any
    description: str
    read: Callable[[], dict[str, torch.Tensor]]  # every parameter's full tensor by name (both copies of a tied one)
    folder: Path | None = None  # where its tokenizer and generation_config.json may be

    def __str__(self) -> str:
        return self.description


def model_source(args: argparse.Namespace) -> ModelSource:
    """The model's config and a way to read its weights, checked (files, headers, shapes) but not yet read."""
    if args.checkpoint:
        info = resolve_checkpoint(Path(args.checkpoint))
        problems = verify_files(info, sorted(info.files))
        if problems:
            raise CheckpointError(problems[0])
        lora = LoraConfig.from_dict(info.config.get("lora"))  # a LoRA run's: its adapters merged into the weights
        # generation ignores multi-token prediction: the model alone, without its MTP depths' tensors
        model = config_from_dict(info.config["model"])

        def weights() -> dict[str, torch.Tensor]:
            values = merged_weights(load_model_weights(info), scale=lora.scale) if lora else load_model_weights(info)
            return {n: t for n, t in values.items() if not n.startswith(f"{MTP}.")}

        return ModelSource(without_mtp(model), f"{info.path} (step {info.step})", weights, info.path)
    folder = Path(args.init_from)
    if not folder.is_dir():
        raise CheckpointError(f"--init-from {folder}: not a folder; generate reads a Hugging Face model folder "
                              f"(`run.py export --format hf` writes one) or a checkpoint (--checkpoint)")
    weights = check_weights(read_hf_model(folder, mtp_depth=0))
    cfg = weights.model.config
    return ModelSource(cfg, str(folder), lambda: read_state_dict(weights, cfg), folder)


def build(cfg: Any, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model holding ``state`` (no initialisation of its own): built on the meta device, the tensors
    assigned. A tied head gets its own copy of the embedding (both names are in ``state``)."""
    with torch.device("meta"):
        model = spec_of(cfg).build(cfg, share_tied_weights=False)
    model.load_state_dict({name: t.float() for name, t in state.items()}, assign=True)
    return model.eval()


def prompt_ids(args: argparse.Namespace, *, vocab_size: int, codec: TextCodec | None) -> list[int]:
    if args.prompt is not None:
        if codec is None:
            raise ConfigError(f"--prompt: this model's vocabulary has {vocab_size} tokens and no tokenizer.json comes "
                              f"with it; give its tokenizer folder (--tokenizer FOLDER) or token ids (--prompt-ids)")
        ids = codec.encode(args.prompt)
        if not ids:
            raise ConfigError("--prompt is empty: give at least one character")
        return ids
    try:
        ids = [int(x) for x in args.prompt_ids.split(",")]
    except ValueError:
        raise ConfigError(f"--prompt-ids {args.prompt_ids!r}: give comma-separated integers, e.g. 464,11361") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"--prompt-ids: token id {bad[0]} is outside this model's vocabulary (0 to {vocab_size - 1})")
    return ids


def _check_length(prompt: int, new: int, *, limit: int) -> None:
    """The prompt and every new token but the last (never fed back) must fit the model's positions."""
    if prompt > limit:
        raise ConfigError(f"the prompt has {prompt} tokens; this model takes at most {limit} positions")
    if prompt + new - 1 > limit:
        raise ConfigError(f"--max-new-tokens {new}: the prompt's {prompt} tokens and {new} new ones need "
                          f"{prompt + new - 1} positions, this model has {limit}; at most {limit - prompt + 1} new tokens")
