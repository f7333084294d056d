"""LoRA through the engine and back out: peft's adapter (tests/fixtures/peft/llama3-lora) trained further on its
base folder over 2 tensor-parallel ranks, then exported merged (``--format hf``) and as peft's files (``--format
peft``); ``run.py eval`` of the checkpoint, of the merged folder and of the base with the exported adapter
(``--lora-from``) must agree, the base must come back unchanged and only the adapters hold AdamW state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compiler.lora import is_adapter
from runtime.checkpoint.files import read_checkpoint, read_dcp_metadata
from runtime.checkpoint.hf_weights import check_weights, read_hf_model, read_state_dict
from runtime.checkpoint.peft import ADAPTER_CONFIG, read_adapter
from runtime.checkpoint.weights import load_model_weights, resolve_checkpoint
from tests.paths import FIXTURE_ROOT

pytestmark = pytest.mark.slow  # real multi-process jobs

BASE = FIXTURE_ROOT / "hf-models" / "llama3"
ADAPTER = FIXTURE_ROOT / "peft" / "llama3-lora"
EVALUATED = ("checkpoint", "merged", "exported adapter", "fixture adapter")


def _train_export_evaluate(root: str) -> None:
    """Two ranks (mp 2): train, export on rank 0, evaluate the four weights of ``EVALUATED`` over val.bin, then
    resume on dp 2 for one more step."""
    import torch.distributed as dist

    from runtime.commands import eval as eval_command
    from runtime.commands import export
    from runtime.commands.train import check_inputs, train
    from runtime.device import configure_cpu_threads, select_device
    from runtime.distributed.process_group import LaunchEnv, init_distributed, shutdown_distributed

    env, out = LaunchEnv.from_environ(), Path(root)
    device = select_device(env.local_rank, "cpu")
    configure_cpu_threads(env.local_world_size)
    init_distributed(env, device)
    common = ["--mp", "2", "--precision", "fp32", "--seq-len", "23", "--micro-batch-size", "2"]
    cfg, data, start = check_inputs([*common, "--init-from", str(BASE), "--lora-from", str(ADAPTER), "--steps", "2",
                                     "--warmup-steps", "0", "--lr", "3e-2", "--eval-every", "0", "--peak-tflops", "1",
                                     "--logdir", str(out / "log"), "--checkpoint-dir", str(out / "ckpt")], env)
    train(cfg, data, start, env=env, device=device)
    if env.rank == 0:
        for form in ("hf", "peft"):
            assert export.main(["--checkpoint", str(out / "ckpt"), "--out", str(out / form), "--format", form]) == 0
    dist.barrier()
    weights = (["--checkpoint", str(out / "ckpt")], ["--init-from", str(out / "hf")],
               ["--init-from", str(BASE), "--lora-from", str(out / "peft")],
               ["--init-from", str(BASE), "--lora-from", str(ADAPTER)])
    losses = {}
    for name, flags in zip(EVALUATED, weights):
        argv = [*common, *flags, "--data", str(out / "val.bin"), "--micro-batch-size", "1"]
        losses[name] = eval_command.evaluate(eval_command.check_inputs(argv, env), env=env, device=device).loss
    if env.rank == 0:
        (out / "eval.json").write_text(json.dumps(losses))
    # one more step, resumed on another mesh: the adapters' shards and their AdamW state resharded (dp 2, FSDP)
    cfg, data, start = check_inputs(["--dp", "2", "--precision", "fp32", "--seq-len", "23", "--micro-batch-size", "1",
                                     "--init-from", str(BASE), "--lora-from", str(ADAPTER), "--steps", "3",
                                     "--warmup-steps", "0", "--lr", "3e-2", "--eval-every", "0", "--peak-tflops", "1",
                                     "--logdir", str(out / "resumed"), "--checkpoint-dir", str(out / "ckpt"),
                                     "--resume"], env)
    train(cfg, data, start, env=env, device=device)
    shutdown_distributed()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    from tests.launch import spawn_ranks
    from tests.token_writers import write_nanogpt

    root = tmp_path_factory.mktemp("lora")
    batch = json.loads((BASE / "expected.json").read_text())["batch"]
    write_nanogpt(root / "val.bin", [t for row in batch for t in row])  # two windows of 23 + 1 tokens
    spawn_ranks(_train_export_evaluate, world_size=2, args=(str(root),), timeout=900)
    return root


def test_merged_and_peft_exports_evaluate_as_the_run_does(run):
    losses = json.loads((run / "eval.json").read_text())
    assert losses["merged"] == pytest.approx(losses["checkpoint"], rel=1e-5)
    assert losses["exported adapter"] == pytest.approx(losses["checkpoint"], rel=1e-5)
    assert abs(losses["fixture adapter"] - losses["checkpoint"]) > 1e-3  # training moved the adapters


def test_the_base_stays_as_read_and_only_the_adapters_have_adamw_state(run):
    info = read_checkpoint(run / "ckpt" / "step-000002")
    saved = load_model_weights(info)
    hf = read_hf_model(BASE)
    base = read_state_dict(check_weights(hf), hf.config)
    assert {n for n in saved if not is_adapter(n)} == set(base)
    for name, value in base.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=lambda m: f"{name} moved: {m}")
    _, start = read_adapter(ADAPTER, hf.config)
    assert set(start) == {n for n in saved if is_adapter(n)}
    assert all(not torch.equal(saved[n], start[n]) for n in start if ".lora_B." in n)
    optim = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in read_dcp_metadata(info.path).state_dict_metadata
             if k.startswith("optim.")}
    assert optim == set(start)


def test_the_peft_export_names_the_run_s_source_folder(run):
    config = json.loads((run / "peft" / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(BASE.resolve())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    _, exported = read_adapter(run / "peft", read_hf_model(BASE).config)
    saved = load_model_weights(read_checkpoint(run / "ckpt" / "step-000002"))
    for name, value in exported.items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)


def test_generate_from_the_checkpoint_runs_the_adapted_model(run, capsys):
    """``generate --checkpoint`` of a LoRA run merges its adapters: the merged export's greedy ids, not the base's."""
    from runtime.commands import generate

    ids = {}
    for name, flags in (("checkpoint", ["--checkpoint", str(run / "ckpt" / "step-000002")]),
                        ("merged", ["--init-from", str(run / "hf")]),
                        ("base", ["--init-from", str(BASE)])):
        code = generate.main([*flags, "--prompt-ids", "5,17,2,33,41,8", "--max-new-tokens", "12", "--temperature", "0"])
        out = capsys.readouterr()
        assert code == 0, out.err
        ids[name] = json.loads(out.out.strip().splitlines()[-1])["new_ids"]
    assert ids["checkpoint"] == ids["merged"] != ids["base"]


def test_a_lora_run_resumes_on_another_mesh(run):
    """The checkpoint of the mp 2 run continues on dp 2 (FSDP): its adapters and their AdamW state resharded, the
    base still as read."""
    summary = json.loads((run / "resumed" / "summary.json").read_text())
    assert summary["start_step"] == 2 and len(summary["losses"]) == 1
    saved = load_model_weights(resolve_checkpoint(run / "ckpt"))  # step 3
    before = load_model_weights(read_checkpoint(run / "ckpt" / "step-000002"))
    assert all(torch.equal(saved[n], before[n]) for n in saved if not is_adapter(n))
    assert any(not torch.equal(saved[n], before[n]) for n in saved if is_adapter(n))
