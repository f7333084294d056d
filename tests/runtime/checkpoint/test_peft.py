"""peft's adapter folders, against what peft itself wrote (tests/fixtures/peft/llama3-lora, copied from the shared
fixtures; its README says how it was made): read onto the llama3 folder it was made for, it must give peft's losses
(with the adapter, merged) and logits within 1e-5; written back, it must be byte for byte what peft wrote. GPT-2's
fused, transposed q/k/v checks the feature orders the writer puts adapters in."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from compiler.lora import LoraConfig, is_adapter, merged_weights
from compiler.parallelize.lora import apply_lora, lora_parameter_shapes
from models import named_config, spec_of
from runtime.checkpoint.hf_weights import check_weights, read_hf_model, read_state_dict
from runtime.checkpoint.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter, write_adapter
from runtime.checkpoint.safetensors import TensorFileError, load_file
from runtime.commands.generate import build
from tests.paths import FIXTURE_ROOT

ADAPTER = FIXTURE_ROOT / "peft" / "llama3-lora"
BASE = FIXTURE_ROOT / "hf-models" / "llama3"
ATOL = RTOL = 1e-5  # fixtures/README.md


def _expected() -> dict:
    return json.loads((ADAPTER / "expected.json").read_text())


def _base_model():
    hf = read_hf_model(BASE)
    return hf.config, build(hf.config, read_state_dict(check_weights(hf), hf.config))


def _loss_and_logits(model) -> tuple[float, torch.Tensor]:
    batch = torch.tensor(json.loads((BASE / "expected.json").read_text())["batch"])
    with torch.no_grad():
        logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item(), logits


def _with_adapter(model, lora: LoraConfig, values: dict[str, torch.Tensor]):
    apply_lora(model, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.copy_(values[name])
    return model


def test_peft_s_adapter_on_its_base_gives_peft_s_losses_and_logits():
    cfg, model = _base_model()
    lora, values = read_adapter(ADAPTER, cfg)
    expected = _expected()
    assert (lora.rank, lora.alpha, lora.scale) == (expected["r"], expected["lora_alpha"], expected["scale"])
    assert set(lora.targets) == {"q", "k", "v", "o", "gate", "up", "down"}
    assert _loss_and_logits(model)[0] == pytest.approx(expected["loss_base"], abs=ATOL)
    loss, logits = _loss_and_logits(_with_adapter(model, lora, values))
    assert loss == pytest.approx(expected["loss_with_adapter"], abs=ATOL)
    want = torch.tensor(expected["logits_row0_pos0to3_with_adapter"])
    torch.testing.assert_close(logits[0, :4], want, atol=ATOL, rtol=RTOL)
    merged = merged_weights({n: p.detach() for n, p in model.named_parameters()}, scale=lora.scale)
    assert _loss_and_logits(build(cfg, merged))[0] == pytest.approx(expected["loss_merged"], abs=ATOL)


def test_the_adapter_written_back_is_what_peft_wrote(tmp_path):
    cfg, _ = _base_model()
    lora, values = read_adapter(ADAPTER, cfg)
    assert write_adapter(tmp_path, values, model_cfg=cfg, lora=lora, base_model="../../hf-models/llama3") == [
        ADAPTER_WEIGHTS, ADAPTER_CONFIG]
    assert (tmp_path / ADAPTER_WEIGHTS).read_bytes() == (ADAPTER / ADAPTER_WEIGHTS).read_bytes()
    written, theirs = (json.loads((folder / ADAPTER_CONFIG).read_text()) for folder in (tmp_path, ADAPTER))
    # every field as peft writes it; target_modules is a set in peft (its order is the set's)
    assert set(written.pop("target_modules")) == set(theirs.pop("target_modules"))
    assert written == theirs


def test_gpt2_adapters_go_in_the_files_order_of_features(tmp_path):
    """GPT-2's c_attn is Conv1D ([in, out]) with q | k | v output columns; ours regroups them by head. Merging the
    written peft tensors into the Hugging Face weight (W + s (B A)^T, peft's fan_in_fan_out) must give the export of
    our merged weight, and reading them back our values."""
    cfg = named_config("tiny", n_layers=1)
    lora = LoraConfig(rank=3, alpha=6.0, targets=("qkv", "up"))
    generator = torch.Generator().manual_seed(0)
    shapes = lora_parameter_shapes(cfg, lora)
    state = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
    write_adapter(tmp_path, {n: t for n, t in state.items() if is_adapter(n)}, model_cfg=cfg, lora=lora, base_model=None)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert config["fan_in_fan_out"] and config["target_modules"] == ["c_attn", "c_fc"]
    ours = spec_of(cfg).hf.to_hf(merged_weights(state, scale=lora.scale), cfg)
    theirs = spec_of(cfg).hf.to_hf({n: t for n, t in state.items() if not is_adapter(n)}, cfg)
    adapters = load_file(tmp_path / ADAPTER_WEIGHTS)
    for module in ("transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc"):
        a, b = (adapters[f"base_model.model.{module}.lora_{x}.weight"] for x in "AB")
        torch.testing.assert_close(theirs[f"{module}.weight"] + lora.scale * (b @ a).T, ours[f"{module}.weight"])
    read_lora, values = read_adapter(tmp_path, cfg)
    assert read_lora.targets == ("qkv", "up") and read_lora.rank == 3
    for name, value in values.items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0)


def test_suffixes_that_would_pick_other_modules_are_written_as_full_names(tmp_path):
    """GPT-2's attention and MLP outputs are both ``c_proj``: adapting one names its modules in full."""
    cfg = named_config("tiny", n_layers=2)
    lora = LoraConfig(rank=2, alpha=2.0, targets=("o",))
    adapters = {n: torch.zeros(s) for n, s in lora_parameter_shapes(cfg, lora).items() if is_adapter(n)}
    write_adapter(tmp_path, adapters, model_cfg=cfg, lora=lora, base_model=None)
    assert json.loads((tmp_path / ADAPTER_CONFIG).read_text())["target_modules"] == [
        "transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj"]
    assert read_adapter(tmp_path, cfg)[0].targets == ("o",)


@pytest.mark.parametrize("change,message", [
    ({"use_dora": True}, "use_dora True is not supported"),
    ({"layers_to_transform": [0]}, "layers_to_transform"),
    ({"target_modules": ["q_proj", "lm_head"]}, None),  # lm_head is not adaptable: q alone is read
    ({"target_modules": "model.layers.0.self_attn.q_proj"}, "picks no whole set"),  # one layer's q only
    ({"r": None}, r"adapter_config.json: no 'r' \(peft's LoraConfig writes"),
    ({"r": 4.5}, "adapter_config.json: r 4.5 must be an integer"),
    ({"lora_alpha": "8"}, "adapter_config.json: lora_alpha '8' must be a number"),
])
def test_adapters_this_engine_would_compute_otherwise_are_refused(tmp_path, change, message):
    cfg, _ = _base_model()
    for name in (ADAPTER_WEIGHTS,):
        (tmp_path / name).write_bytes((ADAPTER / name).read_bytes())
    config = {**json.loads((ADAPTER / ADAPTER_CONFIG).read_text()), **change}
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(config))
    if message is None:
        assert read_adapter(tmp_path, cfg)[0].targets == ("q",)
        return
    with pytest.raises(TensorFileError, match=message):
        read_adapter(tmp_path, cfg)


@pytest.mark.parametrize("model", ["tiny", "llama3-debug", "qwen3-debug", "qwen3-moe-debug", "mixtral-debug",
                                   "deepseek-v3-debug"])
def test_every_family_s_adapters_round_trip_through_peft_s_files(tmp_path, model):
    """Every target of every family (the experts one peft module per expert), written and read back unchanged."""
    from compiler.lora import valid_targets

    cfg = named_config(model, n_layers=2) if model != "deepseek-v3-debug" else named_config(model)
    lora = LoraConfig(rank=2, alpha=4.0, targets=valid_targets(cfg))
    generator = torch.Generator().manual_seed(0)
    adapters = {n: torch.randn(s, generator=generator) for n, s in lora_parameter_shapes(cfg, lora).items()
                if is_adapter(n)}
    write_adapter(tmp_path, adapters, model_cfg=cfg, lora=lora, base_model=None)
    read_lora, values = read_adapter(tmp_path, cfg)
    assert set(read_lora.targets) == set(lora.targets) and set(values) == set(adapters)
    for name, value in values.items():
        torch.testing.assert_close(value, adapters[name], rtol=0, atol=0)


def test_an_adapter_config_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / ADAPTER_WEIGHTS).write_bytes((ADAPTER / ADAPTER_WEIGHTS).read_bytes())
    (tmp_path / ADAPTER_CONFIG).write_text("[4, 8]")
    with pytest.raises(TensorFileError, match="adapter_config.json: a JSON list, not peft's LoraConfig object"):
        read_adapter(tmp_path, _base_model()[0])
