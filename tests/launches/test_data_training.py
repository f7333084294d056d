"""Training and evaluating on token files, end to end: each format lowers the validation loss, a run stopped
on 2x2x2 and resumed on (1, 2, 4) reads exactly the uninterrupted run's batches (across an epoch boundary),
and ``run.py eval`` gives a plain forward pass's loss, in one process and on 2x2x2.

Three launches in all: one process trains the three formats (single process: the multi-rank paths are the
same code and are covered by the 8-rank job below and by the parity tests), the CLI evaluates once, and
one 8-rank job runs the resume case and evaluates on 2x2x2.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from models import config_from_dict, spec_of
from runtime.checkpoint.weights import load_model_weights, resolve_checkpoint
from runtime.commands import eval as eval_command
from runtime.commands import export as export_command
from runtime.commands import generate as generate_command
from runtime.commands import tokenize as tokenize_command
from runtime.commands.train import check_inputs, train
from runtime.device import configure_cpu_threads, select_device
from runtime.distributed.process_group import LaunchEnv, init_distributed, shutdown_distributed
from runtime.engine.data.text import builtin_text
from runtime.tokenizer import TOKENIZER_FILES, load_tokenizer
from tests.launch import python_run, spawn_ranks, train_each
from tests.paths import FIXTURE_ROOT
from tests.token_writers import write_llmc, write_megatron, write_nanogpt

pytestmark = pytest.mark.slow  # real multi-process jobs

EOD = 250
GPT2_TOKENIZER = FIXTURE_ROOT / "tokenizers" / "gpt2-style"
SMALL = ["--model", "tiny", "--precision", "fp32", "--seq-len", "32", "--warmup-steps", "2", "--lr", "3e-3",
         "--peak-tflops", "1", "--log-every", "5"]


def _documents(n: int, seed: int) -> list[list[int]]:
    """Learnable documents: arithmetic progressions mod 250, each ended by EOD."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        start, step, length = rng.randrange(250), rng.choice((1, 2, 3)), rng.randrange(20, 60)
        docs.append([(start + k * step) % 250 for k in range(length)] + [EOD])
    return docs


def _flat(docs: list[list[int]]) -> list[int]:
    return [t for d in docs for t in d]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data_training")
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(root / "cache")  # the spawned ranks inherit it
    yield root
    if saved is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = saved


def _tokenized_text(workdir: Path) -> Path:
    """The README's first step: English text (CPython's documentation) through ``run.py tokenize``."""
    (workdir / "corpus.txt").write_text(builtin_text().decode()[:300_000])
    code = tokenize_command.main(["--tokenizer", str(GPT2_TOKENIZER), str(workdir / "corpus.txt"), "--split-documents",
                                  "--out", str(workdir / "text" / "corpus"), "--format", "megatron", "--workers", "1"])
    assert code == 0
    return workdir / "text" / "corpus"


@pytest.fixture(scope="module")
def formats(workdir) -> dict[str, Path]:
    """Format -> the logdir of a 30-step single-process run on it (the nanoGPT run also saves a checkpoint)."""
    (workdir / "nanogpt").mkdir()
    write_nanogpt(workdir / "nanogpt" / "train.bin", _flat(_documents(300, 1)))
    write_nanogpt(workdir / "nanogpt" / "val.bin", _flat(_documents(40, 2)))
    (workdir / "llmc").mkdir()
    for i in range(2):
        write_llmc(workdir / "llmc" / f"prog_train_{i:06d}.bin", _flat(_documents(150, 3 + i)))
    write_llmc(workdir / "llmc" / "prog_val_000000.bin", _flat(_documents(40, 5)))
    megatron = write_megatron(workdir / "prog_text_document", _documents(340, 6), "uint16")
    sources = {"nanogpt": workdir / "nanogpt", "llmc": workdir / "llmc", "megatron": megatron,
               "mixture": f"0.7:{workdir / 'nanogpt' / 'train.bin'},0.3:{workdir / 'llmc'}",
               "text": _tokenized_text(workdir)}
    argvs = [[*SMALL, "--steps", "30", "--eval-every", "5", "--eval-batches", "4", "--data", str(path),
              "--logdir", str(workdir / f"log-{fmt}"),
              *(["--checkpoint-dir", str(workdir / "ckpt")] if fmt == "nanogpt" else []),
              *(["--vocab-size", "2000", "--tokenizer", str(GPT2_TOKENIZER), "--checkpoint-dir", str(workdir / "ckpt-text")]
                if fmt == "text" else [])]
             for fmt, path in sources.items()]
    spawn_ranks(train_each, world_size=1, args=(argvs,), timeout=600)
    return {fmt: workdir / f"log-{fmt}" for fmt in sources}


@pytest.mark.parametrize("fmt", ["nanogpt", "llmc", "megatron"])
def test_training_on_each_format_lowers_the_validation_loss(formats, fmt):
    summary = json.loads((formats[fmt] / "summary.json").read_text())
    val = [loss for _, loss in summary["val_losses"]]
    assert len(val) == 6 and val[-1] < val[0] - 0.3, f"{fmt}: validation loss {val}"
    assert val[-1] < math.log(256) - 1.0  # well below a uniform guess
    source = summary["data"]["sources"][0]
    assert source["epochs"] == pytest.approx(30 * 8 / source["windows"])


def test_text_tokenized_trains_and_the_checkpoint_export_and_generate_carry_the_tokenizer(workdir, formats, capsys):
    """tokenize -> train -> export -> generate text: the README's four commands."""
    summary = json.loads((formats["text"] / "summary.json").read_text())
    val = [loss for _, loss in summary["val_losses"]]
    assert val[-1] < val[0] - 0.5 and summary["config"]["data"]["tokenizer"] == str(GPT2_TOKENIZER)
    checkpoint = resolve_checkpoint(workdir / "ckpt-text")
    present = [name for name in TOKENIZER_FILES if (GPT2_TOKENIZER / name).is_file()]  # GPT-2's has no chat template
    assert "tokenizer.json" in present and not (checkpoint.path / "chat_template.jinja").exists()
    for name in present:  # copied into the checkpoint and hashed in its manifest
        assert (checkpoint.path / name).read_bytes() == (GPT2_TOKENIZER / name).read_bytes()
        assert checkpoint.files[name]["bytes"] == (GPT2_TOKENIZER / name).stat().st_size
    assert export_command.main(["--checkpoint", str(workdir / "ckpt-text"), "--out", str(workdir / "trained"),
                                "--format", "hf"]) == 0
    assert all((workdir / "trained" / name).is_file() for name in present)
    capsys.readouterr()
    assert generate_command.main(["--init-from", str(workdir / "trained"), "--prompt", "The module",
                                  "--max-new-tokens", "8", "--temperature", "0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    tokenizer = load_tokenizer(GPT2_TOKENIZER)
    new = [t for t in result["new_ids"] if t != tokenizer.token_to_id("<|endoftext|>")]
    assert result["prompt_ids"] == tokenizer.encode("The module") and lines[0].startswith("The module")
    assert result["text"] == tokenizer.decode(result["prompt_ids"] + new)[len("The module"):]


def test_a_mixture_reports_its_realised_shares(formats):
    summary = json.loads((formats["mixture"] / "summary.json").read_text())
    sources = summary["data"]["sources"]
    assert [s["weight"] for s in sources] == [0.7, 0.3]
    assert sum(s["share"] for s in sources) == pytest.approx(1.0)
    for s in sources:  # 240 sequences: within a sequence or two of the weights
        assert abs(s["share"] - s["weight"]) <= 2 / 240 and s["epochs"] == pytest.approx(s["share"] * 240 / s["windows"])
    events = EventAccumulator(str(formats["mixture"]))
    events.Reload()
    shares = sorted(tag for tag in events.Tags()["scalars"] if tag.startswith("data/share/"))
    assert shares == ["data/share/0_train.bin", "data/share/1_llmc"]
    assert events.Scalars(shares[0])[-1].value == pytest.approx(sources[0]["share"])


def _plain_forward_loss(checkpoint: Path, val_bin: Path, seq_len: int) -> float:
    """The mean next-token loss of every window of ``val_bin``, by the model alone (no engine code)."""
    info = resolve_checkpoint(checkpoint)
    cfg = config_from_dict(info.config["model"])
    model = spec_of(cfg).build(cfg)
    model.load_state_dict(load_model_weights(info))
    raw = val_bin.read_bytes()
    tokens = torch.tensor([int.from_bytes(raw[i:i + 2], "little") for i in range(0, len(raw), 2)])
    n = (len(tokens) - 1) // seq_len
    windows = torch.stack([tokens[w * seq_len: w * seq_len + seq_len + 1] for w in range(n)])
    with torch.no_grad():
        logits = model(windows[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()


def test_eval_gives_a_plain_forward_pass_loss_over_every_window(workdir, formats):
    result = python_run(["eval", "--checkpoint", str(workdir / "ckpt"), "--data", str(workdir / "nanogpt")], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    want = _plain_forward_loss(workdir / "ckpt", workdir / "nanogpt" / "val.bin", 32)
    windows = (len((workdir / "nanogpt" / "val.bin").read_bytes()) // 2 - 1) // 32
    assert report["windows"] == windows and report["tokens"] == windows * 32 and report["step"] == 30
    assert report["loss"] == pytest.approx(want, rel=1e-5)
    assert report["perplexity"] == pytest.approx(math.exp(want), rel=1e-5)
    summary = json.loads((formats["nanogpt"] / "summary.json").read_text())
    assert abs(report["loss"] - summary["final_val_loss"]) < 0.2  # training's 4-batch estimate of the same


def _resume_and_evaluate(train_argvs: list[list[str]], eval_argvs: list[list[str]], out_dir: str) -> None:
    """One rank: train each argv in turn (as ``train_each``), then evaluate each eval argv on the same group."""
    env = LaunchEnv.from_environ()
    device = select_device(env.local_rank)
    configure_cpu_threads(env.local_world_size)
    init_distributed(env, device)
    for argv in train_argvs:
        cfg, data, start = check_inputs(argv, env)
        train(cfg, data, start, env=env, device=device)
    for i, argv in enumerate(eval_argvs):
        result = eval_command.evaluate(eval_command.check_inputs(argv, env), env=env, device=device)
        if env.rank == 0:
            Path(out_dir, f"eval{i}.json").write_text(json.dumps({"loss": result.loss, "tokens": result.tokens}))
    shutdown_distributed()


def test_a_run_stopped_on_2x2x2_resumes_on_1x2x4_with_the_uninterrupted_losses(workdir, formats):
    # 120 windows of 33 tokens: an epoch is 7.5 steps of 16, so the resumed steps lie in the second epoch.
    corpus = write_nanogpt(workdir / "resume.bin", _flat(_documents(200, 9))[: 120 * 32 + 1])
    common = [*SMALL, "--steps", "12", "--eval-every", "0", "--log-every", "1", "--global-batch-size", "16",
              "--data", str(corpus), "--val-data", str(workdir / "nanogpt" / "val.bin")]
    mesh_222 = ["--dp", "2", "--pp", "2", "--mp", "2", "--micro-batch-size", "2"]
    mesh_124 = ["--dp", "1", "--pp", "2", "--mp", "4", "--micro-batch-size", "4"]
    ckpt = workdir / "resume-ckpt"
    train_argvs = [
        [*common, *mesh_222, "--logdir", str(workdir / "whole")],
        [*common, *mesh_222, "--stop-at-step", "10", "--checkpoint-dir", str(ckpt), "--logdir", str(workdir / "first")],
        [*common, *mesh_124, "--checkpoint-dir", str(ckpt), "--resume", "--logdir", str(workdir / "second")],
    ]
    export = workdir / "model.pt"
    torch.save(load_model_weights(resolve_checkpoint(workdir / "ckpt")), export)
    eval_args = ["--data", str(workdir / "nanogpt"), *mesh_222, "--seq-len", "32"]
    eval_argvs = [["--checkpoint", str(workdir / "ckpt"), *eval_args], ["--init-from", str(export), *eval_args]]
    spawn_ranks(_resume_and_evaluate, world_size=8, args=(train_argvs, eval_argvs, str(workdir)), timeout=900)

    whole, first, second = (json.loads((workdir / d / "summary.json").read_text()) for d in ("whole", "first", "second"))
    assert first["losses"] == pytest.approx(whole["losses"][:10], rel=1e-6)
    assert second["start_step"] == 10 and len(second["losses"]) == 2
    assert second["losses"] == pytest.approx(whole["losses"][10:], rel=1e-5)
    assert second["data"]["sources"][0]["epochs"] == pytest.approx(12 * 16 / 120)

    want = _plain_forward_loss(workdir / "ckpt", workdir / "nanogpt" / "val.bin", 32)
    for i in range(2):  # the checkpoint and its export, on 2x2x2
        assert json.loads((workdir / f"eval{i}.json").read_text())["loss"] == pytest.approx(want, rel=1e-5)
