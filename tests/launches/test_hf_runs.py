"""Hugging Face folders on real ranks: ``--init-from FOLDER`` starts 1x1x1 and 2x2x2 runs whose first loss is
the loss a reference forward of the folder's tensors computes; ``export --format hf`` writes the folder back
(identical tensors, an equivalent config.json, sharded past --max-shard-size, and what the engine does not model
carried from the folder: token ids, generation_config.json), also after training on windows shorter than the
folder's context (transformers' own 256-position GPT-2 at --seq-len 64); ``generate --checkpoint`` gives the
reference model's greedy tokens.

Two launches in all: one rank trains every 1x1x1 case in turn, eight ranks every 2x2x2 case (train_each).
The 1x1x1 runs take one step at a learning rate of 1e-30, so their checkpoints hold the folder's values
exactly (an fp32 weight moves by less than its last bit), and export must give the folder back.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models import FAMILIES
from runtime.commands import export, generate
from runtime.engine.data import build_data, inputs_and_targets
from tests.hf_folders import Folder, gpt2_config, llama_config, read_folder, write_folder
from tests.hf_reference import parse_safetensors
from tests.launch import QUICK_RUN, spawn_ranks, train_each
from tests.models.test_generation import full_sequence_greedy
from tests.paths import FIXTURE_ROOT
from tests.runtime.checkpoint.test_hf_weights import reference_logits

pytestmark = [pytest.mark.slow,  # real multi-process jobs
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]  # export reads in-process

COMMON = ["--precision", "fp32", "--steps", "1", "--micro-batch-size", "2", "--warmup-steps", "0", "--lr", "1e-30",
          "--log-every", "1", *QUICK_RUN]
GENERATION_STD = (1.0, 0.05)  # an untied GPT-2 whose greedy decoding varies (tests/hf_folders.py)

FIXTURES = FIXTURE_ROOT / "hf-models"  # written by transformers
# A copy of transformers' GPT-2 (256 positions) as an Instruct model's would be: a list of end-of-text ids.
TRANSFORMERS_GPT2 = "transformers-gpt2-256-positions-at-64"
EOS_LIST = [0, 7]

# name: (config, write_folder options, flags); every folder has 4 layers (2x2x2 interleaved cuts 4 stages)
ONE_RANK = {
    "gpt2-tied": (gpt2_config(n_positions=32), {}, []),
    "gpt2-untied": (gpt2_config(n_positions=32, tied=False), dict(std=GENERATION_STD), []),
    "llama-4x-tied": (llama_config(generation=4), {}, ["--seq-len", "32"]),
    "llama-5x-untied-bf16": (llama_config(generation=5, tied=False, head_dim=24), dict(dtype="BF16", shards=2),
                             ["--seq-len", "32"]),
    TRANSFORMERS_GPT2: (None, {}, ["--seq-len", "64"]),  # 3 layers: one rank only
}
EIGHT_RANKS = {
    # bf16 shards, old attention-mask buffers, trained on 16 of the folder's 32 positions
    "gpt2-untied-bf16-sharded-shorter": (gpt2_config(n_positions=32, tied=False),
                                         dict(dtype="BF16", shards=3, extra={f"transformer.h.{i}.attn.bias": [1, 1, 32, 32]
                                                                             for i in range(4)}), ["--seq-len", "16"]),
    "llama-5x-gqa-head-dim-sharded": (llama_config(generation=5, kv_heads=2, head_dim=24, tied=False), dict(shards=2),
                                      ["--seq-len", "32"]),
}


@dataclass
class Run:
    folder: Folder
    summary: dict
    checkpoint: Path
    global_batch: int
    seq_len: int


def _transformers_folder(path: Path) -> Folder:
    shutil.copytree(FIXTURES / "gpt2", path)
    config = {**json.loads((path / "config.json").read_text()), "eos_token_id": EOS_LIST}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return Folder(path, config, tuple(parse_safetensors(path / "model.safetensors")[2]))


def _argv(folder: Folder, flags: list[str], root: Path, mesh: list[str]) -> list[str]:
    return ["--init-from", str(folder.path), *mesh, *COMMON, *flags, "--logdir", str(root / "log"),
            "--checkpoint-dir", str(root / "ckpt")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("hf_runs")
    # world: (cases, mesh flags, global batch: micro-batch 2 x micro-batches 2 x pp x dp)
    jobs = {1: (ONE_RANK, [], 2 * 2), 8: (EIGHT_RANKS, ["--dp", "2", "--pp", "2", "--mp", "2"], 2 * 4 * 2)}
    out = {}
    for world, (cases, mesh, global_batch) in jobs.items():
        argvs = []
        for name, (config, options, flags) in cases.items():
            folder = (_transformers_folder(root / "folders" / name) if name == TRANSFORMERS_GPT2 else
                      write_folder(root / "folders" / name, config, **options))
            argvs.append(_argv(folder, flags, root / name, mesh))
            seq_len = int(flags[flags.index("--seq-len") + 1]) if "--seq-len" in flags else folder.config["n_positions"]
            out[name] = Run(folder, {}, root / name / "ckpt", global_batch, seq_len)
        if world == 1:
            # A restart with the same command line plus --resume: the folder gives the model (no flag could:
            # its RoPE scaling has an original context of 16), the checkpoint the weights; one more step.
            first = argvs[list(cases).index(RESUMED)]
            argvs.append([*first, "--resume", "--steps", "2", "--logdir", str(root / "resumed")])
        spawn_ranks(functools.partial(train_each), world_size=world, args=(argvs,), timeout=600)
    for name, run in out.items():
        run.summary = json.loads((root / name / "log" / "summary.json").read_text())
    out["resumed"] = Run(out[RESUMED].folder, json.loads((root / "resumed" / "summary.json").read_text()),
                         out[RESUMED].checkpoint, 4, 32)
    return out


RESUMED = "llama-4x-tied"


def test_resume_with_init_from_continues_the_checkpoint_of_the_folders_model(runs):
    resumed = runs["resumed"].summary
    assert resumed["start_step"] == 1 and len(resumed["losses"]) == 1
    assert resumed["config"]["model"] == runs[RESUMED].summary["config"]["model"]
    assert (runs[RESUMED].checkpoint / "latest").read_text().strip() == "step-000002"


@pytest.mark.parametrize("name", [*ONE_RANK, *EIGHT_RANKS])
def test_the_first_loss_is_the_reference_forward_loss_of_the_folder(runs, name):
    run = runs[name]
    assert run.summary["world_size"] == (1 if name in ONE_RANK else 8)
    data = build_data("builtin", vocab_size=256, seq_len=run.seq_len, global_batch_size=run.global_batch, seed=1234,
                      val_fraction=0.1)
    inputs, targets = inputs_and_targets(data.train.rows(0, 0, run.global_batch))
    with torch.no_grad():
        logits = reference_logits(run.folder.config, read_folder(run.folder.path), inputs)
        want = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert run.summary["losses"][0] == pytest.approx(want, rel=1e-5)


def _tensors(folder: Path) -> dict[str, tuple]:
    """Every tensor of a folder's safetensors files (reference parser): name -> (dtype, shape, raw bytes)."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(parse_safetensors(file)[2])
    return out


@pytest.mark.parametrize(("name", "flags"), [
    ("gpt2-tied", []),
    ("gpt2-untied", ["--max-shard-size", "100kB"]),
    ("llama-4x-tied", ["--max-shard-size", "0.2MB"]),
    ("llama-5x-untied-bf16", ["--dtype", "bf16"]),
    (TRANSFORMERS_GPT2, []),  # trained on 64 of its 256 positions: every tensor comes back whole
])
def test_export_hf_writes_the_folder_back(runs, tmp_path, name, flags):
    run, out = runs[name], tmp_path / "exported"
    assert export.main(["--checkpoint", str(run.checkpoint), "--out", str(out), "--format", "hf", *flags]) == 0
    assert _tensors(out) == _tensors(run.folder.path)
    carried = sorted(p.name for p in run.folder.path.glob("generation_config.json"))
    if "--max-shard-size" in flags:
        assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*-of-*.safetensors"))) > 2
    else:
        assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", *carried])
    for file in carried:
        assert (out / file).read_bytes() == (run.folder.path / file).read_bytes()
    original, written = run.folder.config, json.loads((out / "config.json").read_text())
    adapter = next(s.hf for s in FAMILIES.values() if original["architectures"][0] in s.hf.architectures)
    assert adapter.config_from_hf(written) == adapter.config_from_hf(original)  # the same model, either generation
    assert written["architectures"] == original["architectures"]
    assert {k: written.get(k) for k in TOKEN_IDS} == {k: original.get(k) for k in TOKEN_IDS}


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def test_export_after_a_shorter_window_keeps_the_context_and_the_eos_list_in_either_format(runs, tmp_path, capsys):
    run = runs[TRANSFORMERS_GPT2]
    assert run.summary["config"]["model"]["seq_len"] == 64
    source = {name: shape for name, (_, shape, _) in _tensors(run.folder.path).items()}
    assert source["transformer.wpe.weight"] == [256, 48]
    for fmt in ("hf", "gpt2"):
        out = tmp_path / fmt
        assert export.main(["--checkpoint", str(run.checkpoint), "--out", str(out), "--format", fmt]) == 0
        config = json.loads((out / "config.json").read_text())
        assert (config["n_positions"], config["n_ctx"], config["eos_token_id"]) == (256, 256, EOS_LIST)
        assert (out / "generation_config.json").read_bytes() == (FIXTURES / "gpt2" / "generation_config.json").read_bytes()
        shapes = ({name: shape for name, (_, shape, _) in _tensors(out).items()} if fmt == "hf" else
                  {name: list(t.shape) for name, t in torch.load(out / "pytorch_model.bin", weights_only=True).items()})
        assert shapes == source
    assert f"carried bos_token_id, eos_token_id, generation_config.json from {run.folder.path}" in capsys.readouterr().out


@pytest.mark.parametrize(("name", "new"), [("gpt2-untied", 30), ("llama-4x-tied", 60)])
def test_generate_from_a_checkpoint_gives_the_reference_models_greedy_tokens(runs, capsys, name, new):
    # Llama: 62 positions, beyond the 32 it trained on (RoPE), within the folder's 128.
    run = runs[name]
    code = generate.main(["--checkpoint", str(run.checkpoint), "--prompt", "Hi", "--max-new-tokens", str(new),
                          "--temperature", "0"])
    out = capsys.readouterr()
    assert code == 0, out.err
    result = json.loads(out.out.strip().splitlines()[-1])
    tensors = read_folder(run.folder.path)
    want = full_sequence_greedy(lambda seq: reference_logits(run.folder.config, tensors, seq),
                                torch.tensor([list(b"Hi")]), new)[0].tolist()
    assert result["new_ids"] == want and len(set(want)) > 5
    assert result["text"] == bytes(want).decode("utf-8", errors="replace")


def test_export_gpt2_still_writes_pytorch_model_bin_and_refuses_llama(runs, tmp_path, capsys):
    out = tmp_path / "bin"
    assert export.main(["--checkpoint", str(runs["gpt2-tied"].checkpoint), "--out", str(out), "--format", "gpt2"]) == 0
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    folder = read_folder(runs["gpt2-tied"].folder.path)
    assert state.keys() == folder.keys() and all(torch.equal(state[k], folder[k]) for k in folder)
    capsys.readouterr()
    assert export.main(["--checkpoint", str(runs["llama-4x-tied"].checkpoint), "--out", str(tmp_path / "x"),
                        "--format", "gpt2"]) == 2
    assert "holds a llama3 model; use --format hf" in capsys.readouterr().err
