"""Qwen3, Qwen3-MoE and Mixtral checked against transformers: the tiny folders transformers wrote
(tests/fixtures/hf-models/, copied from shared/fixtures/hf-models/, whose README says how they were made), read by the
engine's own reader (runtime/checkpoint/hf_weights.py), run by the engine's model in fp32, compared with what
transformers computed (``expected.json``): loss and the first logits within 1e-5, the 16 greedy ids exactly (a
forward per token, the KV cache, ``run.py generate``), tensors and config.json written back as the files hold them.
No code of ours wrote these numbers, so a convention error (q/k norm placement, head_dim, GQA mapping, expert order,
router softmax or renormalisation, the combine) fails here.

A family is one row of ``FAMILY_OF`` (the same table as tests/test_hf_fixtures.py's, for the dense families).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models import KVCache, generate, parameter_count
from runtime.checkpoint.hf_weights import check_weights, read_hf_model, read_state_dict
from runtime.commands import generate as generate_command
from runtime.commands.generate import build
from tests.hf_reference import parse_safetensors
from tests.test_generation import full_sequence_greedy

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf-models"

# Fixture folder -> the engine family that must read it.
FAMILY_OF = {"qwen3": "qwen3", "qwen3-moe": "qwen3_moe", "mixtral": "mixtral"}

# fixtures/README.md: logits reach about 7; transformers' own sdpa and eager attention differ by up to 6e-6.
ATOL, RTOL = 1e-5, 1e-5


def _expected(name: str) -> dict:
    return json.loads((FIXTURES / name / "expected.json").read_text())


def _engine_model(name: str):
    """The engine's model of the folder, read by the engine's reader."""
    hf = read_hf_model(FIXTURES / name)
    return hf, build(hf.config, read_state_dict(check_weights(hf), hf.config))


def test_every_row_has_its_folder():
    assert all((FIXTURES / name / "expected.json").is_file() for name in FAMILY_OF)


@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_the_reader_finds_the_family_and_every_tensor_of_the_file(name):
    expected = _expected(name)
    hf = read_hf_model(FIXTURES / name)
    assert hf.spec.family == FAMILY_OF[name]
    weights = check_weights(hf)
    assert weights.unused == ()  # every tensor transformers saved is one the model reads
    assert {n: math.prod(weights.folder.info(n).shape) for n in weights.folder.names()} == expected["param_counts"]
    assert parameter_count(hf.config) == expected["model_num_parameters"]


@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_loss_and_first_logits_are_transformers(name):
    expected = _expected(name)
    _, model = _engine_model(name)
    batch = torch.tensor(expected["batch"])  # (2, 24)
    with torch.no_grad():
        logits = model(batch)  # (2, 24, V), fp32
    torch.testing.assert_close(logits[0, :4], torch.tensor(expected["logits_row0_pos0to3"]), atol=ATOL, rtol=RTOL)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten()).item()
    assert loss == pytest.approx(expected["loss"], abs=ATOL, rel=RTOL)


@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_greedy_ids_are_transformers_with_and_without_the_cache(name):
    expected = _expected(name)
    hf, model = _engine_model(name)
    prompt, want = torch.tensor([expected["prompt"]]), expected["greedy_new_ids"]
    assert full_sequence_greedy(model, prompt, len(want))[0].tolist() == want  # a forward per token, as transformers
    assert generate(model, prompt, n_layers=hf.config.n_layers, max_new_tokens=len(want))[0].tolist() == want


@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_cached_chunks_give_the_logits_of_one_forward(name):
    # Several new tokens at once after cached ones (the MoE routes each chunk's tokens on their own).
    expected = _expected(name)
    hf, model = _engine_model(name)
    tokens = torch.tensor(expected["batch"])  # (2, 24)
    cache = KVCache(hf.config.n_layers, capacity=24)
    with torch.no_grad():
        chunks = [model(tokens[:, a:b], cache=cache) for a, b in ((0, 5), (5, 6), (6, 17), (17, 24))]
        torch.testing.assert_close(torch.cat(chunks, dim=1), model(tokens), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_run_py_generate_on_the_folder_gives_transformers_greedy_ids(name, capsys):
    expected = _expected(name)
    code = generate_command.main(["--init-from", str(FIXTURES / name), "--prompt-ids",
                                  ",".join(map(str, expected["prompt"])), "--max-new-tokens",
                                  str(len(expected["greedy_new_ids"])), "--temperature", "0"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out.strip().splitlines()[-1])["new_ids"] == expected["greedy_new_ids"]


@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_the_adapter_writes_the_files_tensors_back(name):
    hf = read_hf_model(FIXTURES / name)
    ours = read_state_dict(check_weights(hf), hf.config)
    written = hf.spec.hf.to_hf(ours, hf.config)
    _, _, saved = parse_safetensors(FIXTURES / name / "model.safetensors")  # the reference parser
    assert sorted(written) == sorted(saved)
    for hf_name, (dtype, shape, raw) in saved.items():
        assert dtype == "F32" and list(written[hf_name].shape) == shape, hf_name
        assert bytes(written[hf_name].contiguous().flatten().view(torch.uint8).tolist()) == raw, hf_name


@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_the_adapter_writes_the_files_config_fields_back(name):
    """Every key of the fixture's config.json that our config.json writes has the fixture's value (a null
    head_dim means d_model / n_heads), and both read to the same config."""
    config = json.loads((FIXTURES / name / "config.json").read_text())
    hf = read_hf_model(FIXTURES / name)
    written = hf.spec.hf.config_to_hf(hf.config)
    derived = {"head_dim": config["hidden_size"] // config["num_attention_heads"]}
    shared = sorted(set(config) & set(written) - {"initializer_range"})  # the fixture's 0.2 is its random weights'
    assert {"architectures", "rope_parameters", "dtype", "num_hidden_layers", "vocab_size"} <= set(shared)
    differ = {k: (config[k], written[k]) for k in shared
              if written[k] != (derived.get(k) if config[k] is None and k in derived else config[k])}
    assert not differ, differ
    assert hf.spec.hf.config_from_hf(written) == hf.config


# ---- through the engine: a training step from the folder, eval and export of its checkpoint, generate -------------

def _train_then_evaluate(train_argvs: list[list[str]], eval_argvs: list[list[str]], out_dir: str) -> None:
    """One rank: train each argv (the engine's trace, stages and schedule), then evaluate each eval argv."""
    from runtime.commands import eval as eval_command
    from runtime.commands.train import check_inputs, train
    from runtime.device import configure_cpu_threads, select_device
    from runtime.distributed.process_group import LaunchEnv, init_distributed, shutdown_distributed

    env = LaunchEnv.from_environ()
    device = select_device(env.local_rank, "cpu")
    configure_cpu_threads(env.local_world_size)
    init_distributed(env, device)
    for argv in train_argvs:
        cfg, data, start = check_inputs(argv, env)
        train(cfg, data, start, env=env, device=device)
    for i, argv in enumerate(eval_argvs):
        result = eval_command.evaluate(eval_command.check_inputs(argv, env), env=env, device=device)
        Path(out_dir, f"eval{i}.json").write_text(json.dumps({"loss": result.loss, "tokens": result.tokens}))
    shutdown_distributed()


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory) -> Path:
    """Per folder: one fp32 step at a learning rate too small to move an fp32 weight (so the checkpoint holds the
    folder's values), a checkpoint; then ``run.py eval`` of it over a token file of two windows."""
    from tests.launch import spawn_ranks
    from tests.token_writers import write_nanogpt

    root = tmp_path_factory.mktemp("moe_runs")
    train_argvs, eval_argvs = [], []
    for name in FAMILY_OF:
        tokens = [t for row in _expected(name)["batch"] for t in row]  # 48 tokens: two windows of 23 + 1
        (root / name).mkdir()
        write_nanogpt(root / name / "val.bin", tokens)
        train_argvs.append(["--init-from", str(FIXTURES / name), "--precision", "fp32", "--steps", "1", "--seq-len",
                            "23", "--micro-batch-size", "2", "--warmup-steps", "0", "--lr", "1e-30", "--eval-every",
                            "0", "--peak-tflops", "1", "--logdir", str(root / name / "log"),
                            "--checkpoint-dir", str(root / name / "ckpt")])
        eval_argvs.append(["--checkpoint", str(root / name / "ckpt"), "--data", str(root / name / "val.bin"),
                           "--seq-len", "23", "--micro-batch-size", "2", "--precision", "fp32"])
    spawn_ranks(_train_then_evaluate, world_size=1, args=(train_argvs, eval_argvs, str(root)), timeout=600)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_eval_of_the_checkpoint_is_the_plain_forward_loss(engine_runs, name):
    report = json.loads((engine_runs / f"eval{list(FAMILY_OF).index(name)}.json").read_text())
    _, model = _engine_model(name)
    tokens = torch.tensor([t for row in _expected(name)["batch"] for t in row])
    windows = torch.stack([tokens[0:24], tokens[23:47]])  # windows of 23 + 1 tokens, one token apart
    with torch.no_grad():
        want = F.cross_entropy(model(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten()).item()
    assert report["tokens"] == 46 and report["loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_export_hf_of_the_checkpoint_writes_the_folder_back(engine_runs, tmp_path, name):
    from runtime.commands import export

    assert export.main(["--checkpoint", str(engine_runs / name / "ckpt"), "--out", str(tmp_path / "out"),
                        "--format", "hf"]) == 0
    _, _, saved = parse_safetensors(FIXTURES / name / "model.safetensors")
    _, _, written = parse_safetensors(tmp_path / "out" / "model.safetensors")
    assert written == saved  # names, dtypes, shapes and bytes
    config = json.loads((FIXTURES / name / "config.json").read_text())
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["dtype"] == exported["torch_dtype"] == "float32"
    assert read_hf_model(tmp_path / "out").config == read_hf_model(FIXTURES / name).config
    assert {k: exported[k] for k in ("architectures", "model_type")} == {k: config[k] for k in ("architectures",
                                                                                              "model_type")}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_generate_from_the_checkpoint_gives_transformers_greedy_ids(engine_runs, name, capsys):
    expected = _expected(name)
    code = generate_command.main(["--checkpoint", str(engine_runs / name / "ckpt"), "--prompt-ids",
                                  ",".join(map(str, expected["prompt"])), "--max-new-tokens",
                                  str(len(expected["greedy_new_ids"])), "--temperature", "0"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out.strip().splitlines()[-1])["new_ids"] == expected["greedy_new_ids"]
