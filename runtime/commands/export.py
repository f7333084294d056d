"""``python run.py export``: a checkpoint's model weights as one file, or as a Hugging Face model folder.

    python run.py export --checkpoint DIR/step-000020 --out model.pt                 # --init-from takes it
    python run.py export --checkpoint DIR --out folder --format hf                   # GPT2LMHeadModel / LlamaForCausalLM
    python run.py export --checkpoint DIR --out gpt2-folder --format gpt2            # GPT-2 as pytorch_model.bin
    python run.py export --checkpoint DIR --out folder --format hf --export-dtype mxfp4  # gpt-oss's experts as released
    python run.py export --checkpoint DIR --out adapter --format peft                # a LoRA run's adapters, for peft

``pt`` is a plain ``{name: full tensor}`` state dict that the model's ``load_state_dict`` accepts. ``hf``
is a folder with ``config.json`` and ``model.safetensors`` (or shards past ``--max-shard-size`` and their
index) in the family's Hugging Face layout (models/<family>/hf.py: GPT-2's Conv1D transposes and fused
q/k/v, Llama's names; a tied head is not saved), which ``from_pretrained(folder)`` loads as it is and
``--init-from`` and ``run.py generate`` read. ``gpt2`` writes GPT-2 the older way, ``config.json`` and
``pytorch_model.bin``. ``--export-dtype fp8-blocks|mxfp4`` stores the tensors the family's released checkpoints
keep quantized in that layout (models/spec.py ``HFAdapter.quantized``; DeepSeek-V3: its decoder layers' linear weights
as FP8 blocks, ``--fp8-block-size``; gpt-oss: its experts in MXFP4; runtime/checkpoint/quantized/) with config.json's
``quantization_config``, the other tensors fp32. It runs in one process (no torchrun) and
reads only the model's tensors.

A model trained from a Hugging Face folder (``--init-from FOLDER``, which the checkpoint records) comes back
with what the engine does not model taken from that folder (runtime/checkpoint/hf_weights.py ``carried_from``):
its ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` (lists included) and its ``generation_config.json``;
otherwise config.json holds the family's defaults. Its shapes are the folder's at any training ``--seq-len``.
A folder export also gets the tokenizer files the checkpoint keeps (the run's ``--tokenizer``, or its
folder's: tokenizer.json, tokenizer_config.json, special_tokens_map.json), so it encodes and decodes text.

A LoRA run's checkpoint (``--lora-rank``) holds its frozen base and its adapters: ``pt``, ``hf`` and ``gpt2`` write the
merged model, W + (alpha / r) B A (compiler/lora/merge.py); ``peft`` writes the adapters alone as peft saves them
(runtime/checkpoint/peft.py), for peft to load onto the run's source folder (``base_model_name_or_path``: the run's
``--init-from``) or ``--lora-from`` to continue from.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from compiler.lora import LoraConfig, is_adapter, merged_weights
from models import FAMILIES, config_from_dict, spec_of
from runtime.atomic import atomic_file, write_json
from runtime.checkpoint.files import CheckpointError, verify_files
from runtime.checkpoint.hf_folder import write_hf_folder
from runtime.checkpoint.hf_weights import carried_from
from runtime.checkpoint.peft import write_adapter
from runtime.checkpoint.quantized.export import METHODS, quantize_for_export
from runtime.checkpoint.safetensors import write_bytes
from runtime.checkpoint.weights import load_model_weights, resolve_checkpoint
from runtime.commands.flag_groups import command_parser
from runtime.config import ConfigError
from runtime.tokenizer import tokenizer_files


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("run.py export", "Write a checkpoint's model weights as one file of full tensors "
                       "({name: tensor}) that the model's load_state_dict accepts.")
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint folder (DIR/step-N), or a checkpoint directory (its latest complete checkpoint)")
    p.add_argument("--out", required=True, help="the .pt file (--format pt) or the folder (hf, gpt2) to write")
    p.add_argument("--format", choices=("pt", "hf", "gpt2", "peft"), default="pt",
                   help="pt: {name: tensor} for --init-from; hf: a Hugging Face folder (config.json + safetensors) of "
                        "either family; gpt2: a Hugging Face GPT2LMHeadModel folder with pytorch_model.bin (a LoRA run: "
                        "its adapters merged into the weights); peft: a LoRA run's adapters as a peft adapter folder")
    p.add_argument("--max-shard-size", default="5GB",
                   help="--format hf: past this many bytes of tensors, shards plus model.safetensors.index.json "
                        "(e.g. 500MB, 2GiB; kB/MB/GB are powers of 10 as in transformers)")
    p.add_argument("--export-dtype", "--dtype", dest="dtype", choices=(*DTYPES, *METHODS), default="fp32",
                   help="--format hf: the tensors' dtype (the checkpoint's weights are fp32), or a released quantized "
                        "layout of the tensors the family's checkpoints ship quantized (fp8-blocks: DeepSeek-V3's "
                        "float8_e4m3fn + a float32 scale per block; mxfp4: gpt-oss's experts in OCP MXFP4), the other "
                        "tensors fp32, with config.json's quantization_config")
    p.add_argument("--fp8-block-size", default="128,128", metavar="ROWS,COLS",
                   help="--export-dtype fp8-blocks: the weight blocks' shape (DeepSeek-V3's release: 128,128)")
    return p


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10**9, '10MiB' -> 10 * 2**20, '1000' -> 1000 (bytes); ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) * _UNITS[match.group(2).lower()] < 1:
        raise ValueError(f"--max-shard-size {text!r}: give a positive size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def main(argv: list[str]) -> int:
    try:  # ConfigError (a ValueError): the flags, before any file is read
        args = build_parser().parse_args(argv)
        max_shard_bytes = parse_size(args.max_shard_size)
        if args.dtype != "fp32" and args.format != "hf":
            raise ConfigError(f"--export-dtype {args.dtype} applies to --format hf; --format {args.format} writes the "
                              f"checkpoint's fp32 tensors (drop --export-dtype, or use --format hf)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        info = resolve_checkpoint(Path(args.checkpoint))
        problems = verify_files(info, sorted(info.files))
        if problems:
            raise CheckpointError(problems[0])
        weights = load_model_weights(info)
        out = Path(args.out)
        init_from = info.config.get("checkpoint", {}).get("init_from")
        lora = LoraConfig.from_dict(info.config.get("lora"))
        if args.format == "peft":
            if lora is None:
                raise CheckpointError(f"--format peft: {info.path} is not a LoRA run's (no --lora-rank); use --format hf")
            cfg = config_from_dict(info.config["model"])
            adapters = {name: t for name, t in weights.items() if is_adapter(name)}
            base = str(Path(init_from).resolve()) if init_from and Path(init_from).is_dir() else init_from
            written = write_adapter(out, adapters, model_cfg=cfg, lora=lora, base_model=base)
            print(f"wrote {out} (peft: {', '.join(written)}): {len(adapters)} adapter tensors, rank {lora.rank}, "
                  f"alpha {lora.alpha:g}, from {info.path} (step {info.step})")
            return 0
        if lora is not None:  # the model as it computes: adapters merged into their weights
            weights = merged_weights(weights, scale=lora.scale)
        carried = carried_from(init_from)
        files = {**carried.files, **tokenizer_files(info.path)}  # the checkpoint's copy of its run's tokenizer
        if args.format == "hf":
            cfg = config_from_dict(info.config["model"])
            hf = spec_of(cfg).hf
            tensors = hf.to_hf(weights, cfg)  # fp32
            if args.dtype in METHODS:  # a released quantized layout of the family's quantized tensors, the rest fp32
                tensors, quantization = _quantized(tensors, hf, cfg.family, args.dtype,
                                                   block_size=_block_size(args.fp8_block_size))
                dtype, config_extra = "float32", {"quantization_config": quantization}
            else:
                tensors = {name: t.to(DTYPES[args.dtype]) for name, t in tensors.items()}
                dtype, config_extra = str(DTYPES[args.dtype]).removeprefix("torch."), {}
            config = {**hf.config_to_hf(cfg), **carried.config, "torch_dtype": dtype, "dtype": dtype,  # 4.x, 5.x
                      **config_extra}
            written = write_hf_folder(out, tensors, config, max_shard_bytes=max_shard_bytes, files=files)
        elif args.format == "gpt2":
            cfg = config_from_dict(info.config["model"])
            if cfg.family != "gpt2":
                raise CheckpointError(f"--format gpt2: {info.path} holds a {cfg.family} model; use --format hf")
            hf = spec_of(cfg).hf
            _write_hf_folder(out, hf.to_hf(weights, cfg), {**hf.config_to_hf(cfg), **carried.config}, files)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            _save_atomically(weights, out)
    except (CheckpointError, OSError, ValueError) as e:  # ValueError: a layout peft cannot hold (peft.py)
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in weights.values())
    where = f" in {', '.join(written.files)}" if args.format == "hf" else ""
    print(f"wrote {out} ({args.format}{where}): {len(weights)} tensors, {n:,} parameters, from {info.path} "
          f"(step {info.step})")
    if args.format != "pt" and carried.describe():
        print(f"carried {carried.describe()} from {info.config['checkpoint']['init_from']}")
    if args.format != "pt" and set(files) - set(carried.files):
        print(f"with the tokenizer the checkpoint keeps: {', '.join(sorted(set(files) - set(carried.files)))}")
    if args.format != "pt" and carried.note:
        print(f"note: {carried.note}", file=sys.stderr)
    return 0


def _quantized(tensors: dict[str, torch.Tensor], hf, family: str, method: str, *,
               block_size: tuple[int, int]) -> tuple[dict[str, torch.Tensor], dict]:
    """The fp32 Hugging Face tensors with those the family stores as ``method`` in that layout, and the config's
    ``quantization_config``; ValueError naming --export-dtype when the family stores nothing so."""
    if method not in hf.quantized:
        which = [f for f, spec in FAMILIES.items() if method in spec.hf.quantized]
        raise ValueError(f"--export-dtype {method}: a {family} model's released checkpoints store nothing as {method} "
                         f"(families that do: {', '.join(which) or 'none'}); export a dtype: {', '.join(DTYPES)}")
    patterns, not_converted = hf.quantized[method]
    export = quantize_for_export(tensors, method=method, which=list(patterns), modules_to_not_convert=not_converted,
                                 block_size=block_size if method == "fp8-blocks" else None)
    return export.tensors, export.quantization_config


def _block_size(text: str) -> tuple[int, int]:
    try:
        blocks = tuple(int(x) for x in text.split(","))
        if len(blocks) == 2 and min(blocks) >= 1:
            return blocks
    except ValueError:
        pass
    raise ValueError(f"--fp8-block-size {text!r}: give ROWS,COLS, two positive integers")


def _save_atomically(obj, path: Path) -> None:
    with atomic_file(path) as f:  # never a half-written export under the real name
        torch.save(obj, f)


def _write_hf_folder(folder: Path, state: dict, config: dict, files: dict[str, bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    _save_atomically(state, folder / "pytorch_model.bin")
    for name, data in files.items():
        write_bytes(folder / name, data)
    write_json(folder / "config.json", config, indent=2)
