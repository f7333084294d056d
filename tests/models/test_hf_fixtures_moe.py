"""Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3 (plain RoPE and two YaRNs) and gpt-oss (plain and MXFP4) against their
folders, beyond what tests/models/test_hf_fixtures.py checks for every family's folder (reader, loss and logits within
1e-5, greedy ids with and without the cache, run.py generate, tensors written back): the cache fed in chunks gives one
forward's logits (the MoE routes each chunk's tokens on their own), config.json written back with the folder's fields
in transformers 5.x spelling, and through the engine (trace, stages, schedule): a training step from the folder,
``run.py eval`` of its checkpoint, ``export --format hf`` of it (the folder's bytes and config; the MXFP4 folder's with
``--export-dtype mxfp4``), ``generate`` from it (transformers' ids).
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models import KVCache
from runtime.checkpoint.hf_weights import check_weights, read_hf_model, read_state_dict
from runtime.commands import generate as generate_command
from runtime.commands.generate import build
from tests.hf_reference import parse_safetensors
from tests.paths import FIXTURE_ROOT

FIXTURES = FIXTURE_ROOT / "hf-models"

# Fixture folder -> the engine family that must read it (rows of tests/models/test_hf_fixtures.py's table too).
FAMILY_OF = {"qwen3": "qwen3", "qwen3-moe": "qwen3_moe", "mixtral": "mixtral", "deepseek-v3": "deepseek_v3",
             "deepseek-v3-yarn": "deepseek_v3", "deepseek-v3-yarn-mscale": "deepseek_v3", "gpt-oss": "gpt_oss",
             "gpt-oss-mxfp4": "gpt_oss"}

# fixtures/README.md: logits reach about 7; transformers' own sdpa and eager attention differ by up to 6e-6.
ATOL, RTOL = 1e-5, 1e-5


def _expected(name: str) -> dict:
    return json.loads((FIXTURES / name / "expected.json").read_text())


def _engine_model(name: str):
    """The engine's model of the folder, read by the engine's reader."""
    hf = read_hf_model(FIXTURES / name)
    return hf, build(hf.config, read_state_dict(check_weights(hf), hf.config))


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
    for i, argv in enumerate(train_argvs):
        with _recorded_reads() as reads:
            cfg, data, start = check_inputs(argv, env)
            train(cfg, data, start, env=env, device=device)
        Path(out_dir, f"reads{i}_rank{env.rank}.json").write_text(json.dumps(reads))
    for i, argv in enumerate(eval_argvs):
        result = eval_command.evaluate(eval_command.check_inputs(argv, env), env=env, device=device)
        Path(out_dir, f"eval{i}.json").write_text(json.dumps({"loss": result.loss, "tokens": result.tokens}))
    shutdown_distributed()


@contextlib.contextmanager
def _recorded_reads():
    """The names of the folder's tensors read meanwhile (in this process), as a reader asks for them: "name" for a
    whole tensor, "name[a:b]" for its rows a..b-1 (a quantized folder's logical tensors, not the parts it decodes)."""
    from runtime.checkpoint.hf_folder import HFFolder
    from runtime.checkpoint.quantized.folder import QuantizedFolder

    reads, inside = [], []
    originals = {(cls, method): getattr(cls, method) for cls in (HFFolder, QuantizedFolder)
                 for method in ("read", "read_rows")}

    def recorded(original):
        def call(self, name, *rows):
            if not inside:  # the reader's own call, not one the folder makes to serve it
                reads.append(f"{name}[{rows[0]}:{rows[1]}]" if rows else name)
            inside.append(name)
            try:
                return original(self, name, *rows)
            finally:
                inside.pop()
        return call

    for (cls, method), original in originals.items():
        setattr(cls, method, recorded(original))
    try:
        yield reads
    finally:
        for (cls, method), original in originals.items():
            setattr(cls, method, original)


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory) -> Path:
    """Per folder, on 2 ranks (dp 2; the mixtures with ep 2, each rank holding half of every layer's experts): one
    fp32 step at a learning rate whose steps underflow fp32 (so the checkpoint holds the folder's values: 1e-30 moves a
    weight that is exactly 0, as many of the MXFP4 folder's are, and its block then quantizes to other bytes),
    a checkpoint; then ``run.py eval`` of it over a token file of two windows."""
    from tests.launch import spawn_ranks
    from tests.token_writers import write_nanogpt

    root = tmp_path_factory.mktemp("moe_runs")
    train_argvs, eval_argvs = [], []
    for name in FAMILY_OF:
        tokens = [t for row in _expected(name)["batch"] for t in row]  # 48 tokens: two windows of 23 + 1
        (root / name).mkdir()
        write_nanogpt(root / name / "val.bin", tokens)
        mesh = ["--dp", "2"] + (["--ep", "2"] if _experts(name) and _experts(name) % 2 == 0 else [])  # qwen3-moe's 5: FSDP alone
        train_argvs.append([*mesh, "--init-from", str(FIXTURES / name), "--precision", "fp32", "--steps", "1", "--seq-len",
                            "23", "--micro-batch-size", "2", "--warmup-steps", "0", "--lr", "1e-50", "--eval-every",
                            "0", "--peak-tflops", "1", "--logdir", str(root / name / "log"),
                            "--checkpoint-dir", str(root / name / "ckpt")])
        eval_argvs.append(["--dp", "2", "--checkpoint", str(root / name / "ckpt"), "--data", str(root / name / "val.bin"),
                           "--seq-len", "23", "--micro-batch-size", "1", "--precision", "fp32"])
    spawn_ranks(_train_then_evaluate, world_size=2, args=(train_argvs, eval_argvs, str(root)), timeout=600)
    return root


def _experts(name: str) -> int:
    return getattr(read_hf_model(FIXTURES / name).config, "n_experts", 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral", "deepseek-v3"])
def test_each_rank_reads_only_its_experts_tensors(engine_runs, name):
    """2 ranks: Mixtral's and DeepSeek-V3's 6 experts with ep 2 (3 per rank), Qwen3-MoE's 5 FSDP-sharded over dp 2
    (rows 0-2 and 3-4): each rank reads from the folder only the tensors of the experts it holds (each expert is its own tensor
    in the files), and both read the dense ones. The export test below checks that they read the folder's values."""
    index = list(FAMILY_OF).index(name)
    for rank in range(2):
        reads = json.loads((engine_runs / f"reads{index}_rank{rank}.json").read_text())
        experts = {int(m.group(1)) for m in map(re.compile(r"\.experts\.(\d+)\.").search, reads) if m}
        assert experts == set(torch.arange(_experts(name)).chunk(2)[rank].tolist()), (rank, sorted(experts))
        assert any("embed_tokens" in n for n in reads)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-oss", "gpt-oss-mxfp4"])
def test_each_rank_reads_only_its_experts_rows(engine_runs, name):
    """gpt-oss's experts are one tensor per layer and kind in the files ([E, ...], MXFP4 in the released layout): with
    ep 2 each rank reads rows 2r..2r+1 of each (a quantized folder decodes only those) and never a whole one."""
    index = list(FAMILY_OF).index(name)
    for rank in range(2):
        reads = json.loads((engine_runs / f"reads{index}_rank{rank}.json").read_text())
        experts = [n for n in reads if ".mlp.experts." in n]
        assert len(experts) == 4 * 4 and all(n.endswith(f"[{2 * rank}:{2 * rank + 2}]") for n in experts), experts
        assert any("embed_tokens" in n for n in reads)


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

    config = json.loads((FIXTURES / name / "config.json").read_text())
    quantize = ["--export-dtype", config["quantization_config"]["quant_method"]] if "quantization_config" in config else []
    assert export.main(["--checkpoint", str(engine_runs / name / "ckpt"), "--out", str(tmp_path / "out"),
                        "--format", "hf", *quantize]) == 0
    _, _, saved = parse_safetensors(FIXTURES / name / "model.safetensors")
    _, _, written = parse_safetensors(tmp_path / "out" / "model.safetensors")
    assert {n: written[n] for n in saved if n in written} == saved  # names, dtypes, shapes and bytes
    # A folder naming multi-token-prediction depths (num_nextn_predict_layers) trains them, from fresh values when it
    # holds none, and the export writes them as DeepSeek's release names them: layer num_hidden_layers on.
    cfg = read_hf_model(FIXTURES / name).config
    depth = [n for n in written if n not in saved]
    assert all(n.startswith(f"model.layers.{cfg.n_layers}.") for n in depth) and bool(depth) == bool(cfg.mtp_depth)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["dtype"] == exported["torch_dtype"] == "float32"
    assert exported.get("quantization_config") == config.get("quantization_config")
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


@pytest.mark.slow
def test_export_in_the_released_fp8_layout_writes_deepseeks_fp8_folder_back(engine_runs, tmp_path):
    """The deepseek-v3 checkpoint (the folder's values) exported as ``--export-dtype fp8-blocks`` with the fixture's
    16 x 16 blocks: the same tensors, bytes and quantization_config as the FP8 folder released-style (the
    fixture README: made from the same weights by DeepSeek's rule), which the engine reads back."""
    from runtime.commands import export

    out = tmp_path / "fp8"
    assert export.main(["--checkpoint", str(engine_runs / "deepseek-v3" / "ckpt"), "--out", str(out), "--format", "hf",
                        "--export-dtype", "fp8-blocks", "--fp8-block-size", "16,16"]) == 0
    _, _, saved = parse_safetensors(FIXTURES / "deepseek-v3-fp8" / "model.safetensors")
    _, _, written = parse_safetensors(out / "model.safetensors")
    assert {n: written[n] for n in saved if n in written} == saved  # names (and scale_inv), dtypes, shapes, bytes
    # the run also trained the folder's MTP depth (num_nextn_predict_layers 1, no tensors in the fixture): written
    # under DeepSeek's release names, layer num_hidden_layers
    layers = read_hf_model(FIXTURES / "deepseek-v3-fp8").config.n_layers
    assert {n.split(".")[2] for n in set(written) - set(saved)} == {str(layers)}
    config = json.loads((out / "config.json").read_text())
    released = json.loads((FIXTURES / "deepseek-v3-fp8" / "config.json").read_text())
    assert config["quantization_config"] == released["quantization_config"]
    assert read_hf_model(out).config == read_hf_model(FIXTURES / "deepseek-v3-fp8").config


def test_a_bad_fp8_block_size_is_one_error():
    from runtime.commands.export import _block_size

    assert _block_size("16,16") == (16, 16)
    for text in ("16", "16,0", "a,b"):
        with pytest.raises(ValueError, match=f"--fp8-block-size '{text}': give ROWS,COLS"):
            _block_size(text)
