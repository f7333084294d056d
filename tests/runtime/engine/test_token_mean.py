"""Chat data's loss, trained in one process: the first step's loss is the mean over the trained (assistant) targets
of the whole global batch, computed here by hand from the model's logits, not a mean of the micro-batches' means,
and micro-batching the same global batch another way leaves it unchanged."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from models import build_model
from runtime.commands.train import check_inputs, train
from runtime.distributed.process_group import LaunchEnv, free_port, init_distributed, shutdown_distributed
from runtime.engine.amp import build_grad_scaler
from runtime.engine.data.inputs import model_batch
from runtime.engine.token_mean import TrainedTokens, trained_token_cross_entropy
from tests.paths import FIXTURE_ROOT

TOKENIZER = FIXTURE_ROOT / "tokenizers" / "chat" / "llama3-style"
ONE_PROCESS = LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)


def _chat_file(path) -> str:
    """Conversations whose assistant turns differ widely in length, so micro-batches train on unequal counts."""
    records = []
    for i in range(24):
        answer = " ".join(["the cat sat on the mat"] * (1 + (i * 7) % 5))
        records.append({"messages": [{"role": "user", "content": "tell me " * (1 + i % 3)},
                                     {"role": "assistant", "content": answer}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _argv(data: str, tmp_path, *, micro_batch_size: int, microbatches: int) -> list[str]:
    return ["--data", data, "--tokenizer", str(TOKENIZER), "--model", "tiny", "--vocab-size", "2048",
            "--seq-len", "64", "--precision", "fp32", "--steps", "1", "--eval-every", "0", "--log-every", "1",
            "--micro-batch-size", str(micro_batch_size), "--microbatches", str(microbatches), "--peak-tflops", "1",
            "--skip-memory-check", "--logdir", str(tmp_path / f"log-{micro_batch_size}x{microbatches}")]


@pytest.fixture
def one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                        ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)


def _first_loss(argv: list[str]) -> float:
    cfg, data, start = check_inputs(argv, ONE_PROCESS)
    init_distributed(ONE_PROCESS, torch.device("cpu"))
    try:
        return train(cfg, data, start, env=ONE_PROCESS, device=torch.device("cpu"))["losses"][0]
    finally:
        shutdown_distributed()


def test_the_loss_is_the_mean_over_the_global_batchs_trained_tokens(one_process, tmp_path):
    data = _chat_file(tmp_path / "chat.jsonl")
    argvs = [_argv(data, tmp_path, micro_batch_size=m, microbatches=4 // m) for m in (4, 1, 2)]

    cfg, sources, _ = check_inputs(argvs[0], ONE_PROCESS)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, seed=cfg.seed)
    batch = cfg.global_batch_size
    inputs, targets = model_batch(sources.train.rows(0, 0, batch), sources.train.positions(0, 0, batch))
    trained = sources.train.loss_mask(0, 0, batch)  # (B, T)
    with torch.no_grad():
        losses = F.cross_entropy(model(*inputs).flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    by_hand = float(losses[trained].sum() / trained.sum())
    assert int(trained.sum()) == sources.train.trained_targets(0)
    for size in (1, 2):  # a mean of micro-batch means is another number, well outside the tolerance below
        parts = [slice(i, i + size) for i in range(0, batch, size)]
        mean_of_means = sum(float(losses[rows][trained[rows]].mean()) for rows in parts) / len(parts)
        assert abs(mean_of_means - by_hand) > 1e-5 * by_hand

    for argv in argvs:
        assert _first_loss(argv) == pytest.approx(by_hand, rel=1e-6), argv


def test_micro_batch_losses_sum_to_the_global_mean_times_the_replicas():
    """R / N x each micro-batch's sum: over micro-batches and R replicas' average, the global mean."""
    torch.manual_seed(0)
    logits, targets = torch.randn(4, 6, 11), torch.randint(11, (4, 6))
    targets[torch.rand(4, 6) < 0.5] = -100
    tokens = TrainedTokens(replicas=2)
    tokens.set(int((targets != -100).sum()))
    loss_fn = trained_token_cross_entropy(build_grad_scaler("fp32", "cpu"), tokens)
    halves = [loss_fn(logits[rows], targets[rows]) for rows in (slice(0, 2), slice(2, 4))]  # two replicas' shares
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(sum(halves) / 2, want)
