"""``python run.py export``: a checkpoint's model weights as one file, or as a Hugging Face GPT-2 folder.

    python run.py export --checkpoint DIR/step-000020 --out model.pt                 # --init-from takes it
    python run.py export --checkpoint DIR --out gpt2-folder --format gpt2            # GPT2LMHeadModel

``pt`` is a plain ``{name: full tensor}`` state dict that the model's ``load_state_dict``
accepts. ``gpt2`` is a folder with ``config.json`` and ``pytorch_model.bin`` in Hugging Face's GPT-2
layout (models/gpt2/hf.py), which ``GPT2LMHeadModel.from_pretrained(folder)`` loads as it is. It runs
in one process (no torchrun) and reads only the model's tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from models import config_from_dict, spec_of
from runtime.checkpoint.files import CheckpointError, verify_files
from runtime.checkpoint.weights import load_model_weights, resolve_checkpoint


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run.py export", description="Write a checkpoint's model weights as one file "
                                "of full tensors ({name: tensor}) that the model's load_state_dict accepts.")
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint folder (DIR/step-N), or a checkpoint directory (its latest complete checkpoint)")
    p.add_argument("--out", required=True, help="the .pt file (--format pt) or the folder (--format gpt2) to write")
    p.add_argument("--format", choices=("pt", "gpt2"), default="pt",
                   help="pt: {name: tensor} for --init-from; gpt2: Hugging Face GPT2LMHeadModel folder")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        info = resolve_checkpoint(Path(args.checkpoint))
        problems = verify_files(info, sorted(info.files))
        if problems:
            raise CheckpointError(problems[0])
        weights = load_model_weights(info)
        out = Path(args.out)
        if args.format == "gpt2":
            cfg = config_from_dict(info.config["model"])
            if cfg.family != "gpt2":
                raise CheckpointError(f"--format gpt2: {info.path} holds a {cfg.family} model; use --format hf")
            hf = spec_of(cfg).hf
            _write_hf_folder(out, hf.to_hf(weights, cfg), hf.config_to_hf(cfg))
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            _save_atomically(weights, out)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in weights.values())
    print(f"wrote {out} ({args.format}): {len(weights)} tensors, {n:,} parameters, from {info.path} "
          f"(step {info.step})")
    return 0


def _save_atomically(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # never leave a half-written export under the real name


def _write_hf_folder(folder: Path, state: dict, config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    _save_atomically(state, folder / "pytorch_model.bin")
    tmp = folder / ".config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, folder / "config.json")
