"""A DeepSeek-V3 folder as DeepSeek released theirs, with its multi-token-prediction layer (transformers' folders have
none): read by ``--init-from`` (the depth from its tensors), trained one step that moves no fp32 weight, checkpointed,
and ``run.py export --format hf`` writes every tensor back bit for bit, the depth's and its copies of the shared
embedding and head included."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from models import build_model, named_config, spec_of
from runtime.checkpoint.hf_folder import write_hf_folder
from runtime.commands import export
from tests.hf_reference import parse_safetensors
from tests.launch import train_runs

pytestmark = [pytest.mark.slow,  # a training run on a spawned rank
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]  # export reads in-process

# The release's own names for layer num_hidden_layers beside its block's (DeepSeek-V3's model.safetensors index).
MTP_PARTS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _release_folder(path, *, seed: int = 3) -> dict[str, torch.Tensor]:
    """deepseek-v3-debug with one MTP depth, its tensors named as DeepSeek's release names them: the model and its
    layer L as a plain DeepSeek-V3 of L + 1 layers names them, the depth's own parts, and copies of the embedding and
    the head. Norms get values of their own, so a depth's norm read in another's place shows."""
    cfg = dataclasses.replace(named_config("deepseek-v3-debug"), mtp_depth=1)
    hf, n = spec_of(cfg).hf, cfg.n_layers
    longer = build_model(dataclasses.replace(cfg, n_layers=n + 1, mtp_depth=0), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in longer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    state = {name: p.detach() for name, p in longer.named_parameters()}
    tensors = hf.to_hf(state, dataclasses.replace(cfg, n_layers=n + 1, mtp_depth=0))  # the family's own names
    for part in MTP_PARTS:
        shape = (cfg.d_model, 2 * cfg.d_model) if part.startswith("eh_proj") else (cfg.d_model,)
        tensors[f"model.layers.{n}.{part}"] = 1 + 0.1 * torch.randn(shape, generator=g)
    tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"]
    write_hf_folder(path, tensors, hf.config_to_hf(cfg))
    return tensors


def test_export_writes_a_release_folder_back_with_its_depth(tmp_path):
    folder = tmp_path / "release"
    written = _release_folder(folder)
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    argv = ["--init-from", str(folder), "--precision", "fp32", "--steps", "1", "--micro-batch-size", "2",
            "--seq-len", "16", "--warmup-steps", "0", "--lr", "1e-30", "--log-every", "1", "--eval-every", "0",
            "--peak-tflops", "1", "--logdir", str(tmp_path / "log"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    (output,) = train_runs([argv], world_size=1, outputs=[tmp_path / "train.log"])
    assert "no tensors of multi-token-prediction depth" not in output  # read, not started fresh
    summary = json.loads((tmp_path / "log" / "summary.json").read_text())
    assert len(summary["mtp_losses"]) == 1  # the depth trained
    assert export.main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--format", "hf"]) == 0
    _, _, saved = parse_safetensors(folder / "model.safetensors")
    _, _, exported = parse_safetensors(tmp_path / "out" / "model.safetensors")
    assert set(exported) == set(saved) == set(written)
    for name, (dtype, shape, raw) in saved.items():
        assert exported[name] == (dtype, shape, raw), name  # dtype, shape and bytes
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 3
