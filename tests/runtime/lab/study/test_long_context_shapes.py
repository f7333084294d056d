"""The long-context limit search for other model shapes (runtime/lab/study/long_context.py ``MODEL_SHAPES``): the
gpt-oss shape's flags reach the config the memory model prices, and its limit is that model's own boundary."""

from __future__ import annotations

from models.gpt_oss.config import GptOssConfig
from runtime.commands.flags import parse_train_config
from runtime.commands.preflight import NodeMemory, predicted_bytes
from runtime.lab.study.long_context import (
    BUDGET_GIB,
    COMMON,
    GPT_OSS_SHAPE,
    RANKS,
    SELECTIVE,
    SHAPE,
    check_spec,
    longest_sequence,
)


def _node_bytes(shape: list[str], *, cp: int, seq_len: int, flags: list[str] = ()) -> float:
    cfg = parse_train_config([*shape, *COMMON, "--seq-len", str(seq_len), "--dp", str(RANKS // cp), "--cp", str(cp),
                              *flags], world_size=RANKS)
    return predicted_bytes(cfg, node_ranks=list(range(RANKS)), memory=NodeMemory(BUDGET_GIB * 2**30 / 0.9))


def test_the_gpt_oss_shape_is_the_preset_at_the_llamas_size():
    cfg = parse_train_config([*GPT_OSS_SHAPE, *COMMON], world_size=1).model
    assert isinstance(cfg, GptOssConfig)
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads) == (4, 256, 8, 4)
    assert cfg.sliding_layers == (0, 2) and cfg.sliding_window == 8 and (cfg.n_experts, cfg.top_k) == (4, 2)


def test_each_shapes_limit_is_its_own_models_boundary():
    step = 2 * 8 * 1024
    for shape in (SHAPE, GPT_OSS_SHAPE):
        for flags in ([], SELECTIVE):
            longest = longest_sequence(8, flags, shape=shape)
            assert _node_bytes(shape, cp=8, seq_len=longest, flags=flags) <= BUDGET_GIB * 2**30
            assert _node_bytes(shape, cp=8, seq_len=longest + step, flags=flags) > BUDGET_GIB * 2**30
    # the two models price differently at one T: the shape is no label
    assert _node_bytes(SHAPE, cp=8, seq_len=65536) != _node_bytes(GPT_OSS_SHAPE, cp=8, seq_len=65536)


def test_a_check_trains_the_given_shape_in_one_cp_group_with_the_given_checkpointing():
    spec = check_spec("c", cp=4, seq_len=16384, shape=GPT_OSS_SHAPE, flags=[])
    args = spec.args
    assert spec.nproc == 4 and args[:len(GPT_OSS_SHAPE)] == GPT_OSS_SHAPE
    assert args[args.index("--dp") + 1] == "1" and args[args.index("--cp") + 1] == "4"
    assert args[args.index("--seq-len") + 1] == "16384" and "--compact-cpu-memory" in args
    assert "--activation-checkpointing" not in args and spec.meta["seq_len"] == 16384
    assert "selective" in check_spec("c", cp=2, seq_len=8192).args  # the study's default: selective
