"""YaRN (models/common/rope.py ``YaRN``) against transformers' formula and the numbers shared/fixtures/README.md
states for the deepseek-v3-yarn, deepseek-v3-yarn-mscale and gpt-oss folders: the ramp's ends, which frequencies
are kept, blended or divided, the cos / sin factor and DeepSeek's softmax factor; config.json read and written in
both transformers generations' spellings."""

from __future__ import annotations

import json
import math

import pytest
import torch

from models.common.hf_config import rope_from_hf, rope_to_hf
from models.common.rope import Rope, YaRN, inverse_frequencies, rotary_cos_sin, yarn_mscale
from tests.paths import FIXTURE_ROOT

FIXTURES = FIXTURE_ROOT / "hf-models"

# gpt-oss's rope_parameters as the README gives them (its folder belongs to the gpt-oss family's tests).
GPT_OSS = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
           "max_position_embeddings": 16384, "head_dim": 16}


def _config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def transformers_yarn(params: dict, dim: int) -> tuple[list[float], float]:
    """_compute_yarn_parameters (transformers 5, modeling_rope_utils.py) transcribed in float64 Python: the
    inverse frequencies and the attention factor."""
    base, factor, original = params["rope_theta"], params["factor"], params["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    else:
        attention_factor = mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    freqs = []
    for i in range(dim // 2):
        pos = base ** (2 * i / dim)
        extrapolation = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        freqs.append(1 / (factor * pos) * (1 - extrapolation) + 1 / pos * extrapolation)
    return freqs, attention_factor


def _yarn(config: dict) -> tuple[float, YaRN]:
    theta, fields = rope_from_hf(config, rope_types=("default", "yarn"))
    return theta, fields["rope_yarn"]


@pytest.mark.parametrize(("config", "dim", "ramp_ends", "unscaled_over_scaled", "cos_sin", "softmax"), [
    # README: low 1, high 3: frequencies 0-1 kept, 2 half-blended, 3 divided by 40; cos/sin x 1; softmax x 1.874
    (_config("deepseek-v3-yarn"), 8, (1, 3), [1, 1, None, 40], 1.0, 1.874),
    # README: low 0, high 2: frequency 0 kept, 1 half-blended, 2-3 divided by 8; 1.2079 / 1.1040; 1.1040^2
    (_config("deepseek-v3-yarn-mscale"), 8, (0, 2), [1, None, 8, 8], 1.0942, 1.2188),
    # README: no floor/ceil: low 2.02, high 4.35; 0-2 kept, 3 and 4 blended, 5-7 divided by 4; 0.1 ln 4 + 1
    (GPT_OSS, 16, (2.02, 4.35), [1, 1, 1, None, None, 4, 4, 4], 1.1386, 1.0),
], ids=["deepseek-v3-yarn", "deepseek-v3-yarn-mscale", "gpt-oss"])
def test_yarn_frequencies_and_factors_are_the_readmes(config, dim, ramp_ends, unscaled_over_scaled, cos_sin, softmax):
    theta, yarn = _yarn(config)
    low, high = yarn.correction_range(dim, theta)
    assert (low, high) == pytest.approx(ramp_ends, abs=5e-3)
    q = torch.zeros(1, 1, 1, dim)
    got = inverse_frequencies(q, Rope(theta=theta, factor=None, yarn=yarn))
    want, attention_factor = transformers_yarn(config["rope_parameters"], dim)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-6, atol=0)
    plain = inverse_frequencies(q, Rope(theta=theta, factor=None))
    ratio = (plain / got).tolist()
    for i, expected in enumerate(unscaled_over_scaled):
        if expected is None:  # blended: strictly between kept and divided
            assert 1 + 1e-3 < ratio[i] < yarn.factor - 1e-3, (i, ratio)
        else:
            assert ratio[i] == pytest.approx(expected, rel=1e-6), (i, ratio)
    assert yarn.cos_sin_factor() == pytest.approx(attention_factor, rel=1e-12)
    assert yarn.cos_sin_factor() == pytest.approx(cos_sin, abs=1e-4)
    assert yarn.softmax_factor() == pytest.approx(softmax, abs=1e-3)


def test_gpt_oss_blends_frequencies_3_and_4_by_the_readmes_weights():
    theta, yarn = _yarn(GPT_OSS)
    got = inverse_frequencies(torch.zeros(1, 1, 1, 16), Rope(theta=theta, factor=None, yarn=yarn))
    plain = 1.0 / theta ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    # f (1 - r) + (f / factor) r: r = (1 - got / f) / (1 - 1 / factor)
    ramp = (1 - got / plain) / (1 - 1 / yarn.factor)
    assert ramp[3:5].tolist() == pytest.approx([0.42, 0.85], abs=5e-3)


def test_the_mscale_factors_are_m_of_factor_and_each_mscale():
    assert yarn_mscale(40.0) ** 2 == pytest.approx(1.874, abs=5e-4)  # DeepSeek-V3's softmax factor
    assert (yarn_mscale(8.0), yarn_mscale(8.0, 0.5)) == pytest.approx((1.2079, 1.1040), abs=5e-5)
    assert yarn_mscale(1.0, 5.0) == yarn_mscale(0.5) == 1.0  # no stretch, no temperature
    given = YaRN(factor=8.0, original_context=64, mscale=1.0, mscale_all_dim=0.5, attention_factor=1.5)
    assert given.cos_sin_factor() == 1.5 and given.softmax_factor() == pytest.approx(1.1040 ** 2, abs=5e-4)


def test_cos_and_sin_carry_the_attention_factor():
    _, yarn = _yarn(_config("deepseek-v3-yarn-mscale"))
    rope = Rope(theta=10000.0, factor=None, yarn=yarn)
    cos, sin = rotary_cos_sin(torch.zeros(1, 5, 2, 8), None, rope)  # (1, T, 1, hd)
    assert cos[0, 0, 0].tolist() == pytest.approx([yarn.cos_sin_factor()] * 8, rel=1e-6)  # position 0: cos 1
    plain_cos, plain_sin = rotary_cos_sin(torch.zeros(1, 5, 2, 8), None, Rope(theta=10000.0, factor=None))
    assert not torch.allclose(cos, plain_cos * yarn.cos_sin_factor())  # the frequencies differ too
    norm = (cos ** 2 + sin ** 2).sqrt()
    torch.testing.assert_close(norm, torch.full_like(norm, yarn.cos_sin_factor()))


@pytest.mark.parametrize("name", ["deepseek-v3-yarn", "deepseek-v3-yarn-mscale"])
def test_both_config_generations_read_to_one_yarn_and_are_written_back_as_given(name):
    config = _config(name)
    params = dict(config["rope_parameters"])
    theta, yarn = _yarn(config)
    older = {"rope_theta": params.pop("rope_theta"), "max_position_embeddings": config["max_position_embeddings"],
             "rope_scaling": {**{k: v for k, v in params.items() if k != "rope_type"}, "type": "yarn"}}
    assert _yarn(older) == (theta, yarn)
    written = rope_to_hf(theta, yarn)
    assert written["rope_parameters"] == config["rope_parameters"]  # no key added (truncate, attention_factor)
    assert _yarn(written) == _yarn({"rope_parameters": written["rope_parameters"]}) == (theta, yarn)
    assert rope_to_hf(*_yarn(GPT_OSS))["rope_parameters"]["truncate"] is False


def test_a_yarn_without_factor_stretches_to_max_position_embeddings():
    config = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 4096},
              "max_position_embeddings": 163840}
    _, yarn = _yarn(config)
    assert (yarn.factor, yarn.beta_fast, yarn.beta_slow, yarn.truncate) == (40.0, 32.0, 1.0, True)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_from_hf({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, rope_types=("yarn",))
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        rope_from_hf(config)  # a family that computes plain RoPE only
