"""``run.py eval --data chat.jsonl``: the loss over the assistant tokens only, every conversation once: equal to a
reference Llama forward's mean over the trained targets, whether the conversations are packed (the document mask
keeps them apart) or one per window."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from runtime.commands import eval as eval_command
from runtime.distributed.process_group import LaunchEnv, free_port, init_distributed, shutdown_distributed
from tests.chat_data import CHAT_TOKENIZERS, mixed_conversations, write_chat
from tests.hf_folders import llama_config, read_folder, reference_config_4x, write_folder
from tests.models.llama3.test_llama3_hf import llama_forward
from tests.models.test_generation import STD

ONE_PROCESS = LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)


@pytest.fixture
def one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                        ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)


def _evaluate(argv: list[str]):
    inputs = eval_command.check_inputs(argv, ONE_PROCESS)
    init_distributed(ONE_PROCESS, torch.device("cpu"))
    try:
        return inputs, eval_command.evaluate(inputs, env=ONE_PROCESS, device=torch.device("cpu"))
    finally:
        shutdown_distributed()


def test_eval_reports_the_assistant_token_loss(one_process, tmp_path):
    config = llama_config(generation=5, layers=2, hidden=32, inner=64, positions=128, vocab_size=2048)
    folder = write_folder(tmp_path / "llama", config, std=STD["llama3"]).path
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(CHAT_TOKENIZERS / "llama3-style" / name, folder / name)
    data = write_chat(tmp_path / "chat.jsonl", mixed_conversations(10))
    common = ["--init-from", str(folder), "--data", str(data), "--seq-len", "128", "--micro-batch-size", "2"]

    inputs, alone = _evaluate([*common, "--no-packing"])
    corpus, tensors = inputs.corpus, read_folder(folder)
    total, count = 0.0, 0
    for g in range(corpus.windows):  # one conversation per window, padding after it: a plain causal forward
        window, trained = corpus.window(g), corpus.target_mask(g)
        with torch.no_grad():
            logits = llama_forward(tensors, reference_config_4x(config), window[None, :-1])[0]
        losses = F.cross_entropy(logits.double(), window[1:], reduction="none")
        total, count = total + float(losses[trained].sum()), count + int(trained.sum())
    assert alone.tokens == count == corpus.trained_total and count < corpus.windows * 128 / 3
    assert alone.loss == pytest.approx(total / count, rel=1e-5)

    inputs, packed = _evaluate(common)
    assert inputs.corpus.windows < corpus.windows and "packed into" in inputs.description
    assert packed.tokens == count and packed.loss == pytest.approx(alone.loss, rel=1e-5)
