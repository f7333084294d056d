"""What context parallelism gathers per attention layer (compiler/context_gather.py): DeepSeek-V3's latent against
its keys and values, the crossover under tensor parallelism, grouped-query attention, and the debug model the
parity tests train."""

from __future__ import annotations

import pytest

from compiler.context_gather import KV, LATENT, context_gather, context_gather_of, cp_gather_problem
from models import named_config
from models.spec import LatentSizes

V3 = LatentSizes(n_heads=128, q_lora_rank=1536, kv_lora_rank=512, nope_dim=128, rope_dim=64, v_dim=128)


def test_deepseek_v3_gathers_its_latent_71_times_fewer_bytes_per_layer():
    gather = context_gather(V3, kv_heads=128, head_dim=192, mp=1)
    assert (gather.gathers, gather.values_per_token, gather.kv_values_per_token) == (LATENT, 576, 40_960)
    # one layer's forward gather of a 4096-token sequence in bf16: 4.7 MB of latent against 335.5 MB of K and V
    latent = gather.gathered_bytes(micro_batch_size=1, seq_len=4096, itemsize=2)
    kv = 4096 * gather.kv_values_per_token * 2
    assert (latent, kv) == (4_718_592, 335_544_320)
    assert kv / latent == pytest.approx(71.1, abs=0.05)


@pytest.mark.parametrize(("mp", "gathers", "values"), [(8, LATENT, 576), (64, LATENT, 576), (128, KV, 320)])
def test_tensor_parallel_ranks_hold_fewer_heads_so_keys_and_values_win_past_the_latents_size(mp, gathers, values):
    gather = context_gather(V3, kv_heads=128, head_dim=192, mp=mp)
    assert (gather.gathers, gather.values_per_token, gather.kv_values_per_token) == (gathers, values, 128 // mp * 320)


def test_grouped_query_attention_gathers_its_rank_s_key_and_value_heads():
    gather = context_gather(None, kv_heads=8, head_dim=128, mp=2)
    assert (gather.gathers, gather.values_per_token) == (KV, 2 * 4 * 128)


def test_configs_of_every_family_read_the_same_rule():
    debug = context_gather_of(named_config("deepseek-v3-debug"), mp=2)  # r 16 + rope 8 against 2 heads x (16 + 12)
    assert (debug.gathers, debug.values_per_token, debug.kv_values_per_token) == (LATENT, 24, 56)
    assert context_gather_of(named_config("llama3-debug"), mp=1).gathers == KV


def test_fp8_runs_gather_keys_and_values_whose_gradients_are_whole_before_kv_b_quantizes_them():
    gather = context_gather(V3, kv_heads=128, head_dim=192, mp=8, fp8=True)
    assert (gather.gathers, gather.values_per_token) == (KV, 16 * 320)
    assert context_gather_of(named_config("deepseek-v3-debug"), mp=1, fp8=True).gathers == KV


@pytest.mark.parametrize(("choice", "mp", "gathers", "values"), [
    ("auto", 1, LATENT, 576), ("auto", 128, KV, 320),  # the size rule
    ("kv", 1, KV, 40_960),  # keys and values though the latent is 71x fewer values (a CPU's gloo: faster)
    ("latent", 128, LATENT, 576),  # the latent though the keys and values are fewer
])
def test_a_plan_s_choice_overrides_the_size_rule(choice, mp, gathers, values):
    gather = context_gather(V3, kv_heads=128, head_dim=192, mp=mp, choice=choice)
    assert (gather.gathers, gather.values_per_token, gather.kv_values_per_token) == (gathers, values, 128 // mp * 320)
    assert context_gather_of(named_config("deepseek-v3-debug"), mp=1, choice=choice).gathers == (
        gathers if choice != "auto" else LATENT)


def test_keys_and_values_are_gathered_for_any_attention_and_the_latent_only_for_latent_attention_without_fp8():
    assert context_gather_of(named_config("llama3-debug"), mp=1, choice=KV).gathers == KV
    assert context_gather(V3, kv_heads=128, head_dim=192, mp=1, fp8=True, choice=KV).gathers == KV
    assert cp_gather_problem(LATENT, latent_attention=True, fp8=False) is None
    with pytest.raises(ValueError, match="^--cp-gather latent needs multi-head latent attention"):
        context_gather_of(named_config("llama3-debug"), mp=1, choice=LATENT)
    with pytest.raises(ValueError, match="^--cp-gather latent cannot run with --fp8"):
        context_gather(V3, kv_heads=128, head_dim=192, mp=1, fp8=True, choice=LATENT)
    with pytest.raises(ValueError, match="^--cp-gather must be one of auto, latent, kv, got keys$"):
        context_gather(V3, kv_heads=128, head_dim=192, mp=1, choice="keys")
