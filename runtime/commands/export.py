"""``python run.py export``: a checkpoint's model weights as one file; ``--init-from`` starts a run from it.

    python run.py export --checkpoint DIR/step-000020 --out model.pt

The export is a plain ``{name: full tensor}`` state dict that ``models.gpt.GPT(config).load_state_dict``
accepts; it runs in one process (no torchrun) and reads only the model's tensors.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from runtime.checkpoint.files import CheckpointError, verify_files
from runtime.checkpoint.weights import load_model_weights, resolve_checkpoint


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run.py export", description="Write a checkpoint's model weights as one file "
                                "of full tensors ({name: tensor}) that models.gpt.GPT.load_state_dict accepts.")
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint folder (DIR/step-N), or a checkpoint directory (its latest complete checkpoint)")
    p.add_argument("--out", required=True, help="the .pt file to write")
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
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        torch.save(weights, tmp)
        os.replace(tmp, out)  # never leave a half-written export under the real name
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in weights.values())
    print(f"wrote {out}: {len(weights)} tensors, {n:,} parameters, from {info.path} (step {info.step})")
    return 0
