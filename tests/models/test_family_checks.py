"""The checks of a family's shapes against the mesh, made before any process group (runtime/commands/train.py
``check_inputs``), for every registered family's debug size: a problem is one line naming the flags, and what splits
passes. Every family: tensor parallelism over 2 ranks passes (with and without sequence parallelism) and an --mp
its heads do not split into is refused; ``FLAG_CASES`` adds each family's own cases (rows per family)."""

from __future__ import annotations

import pytest

from models import FAMILIES
from runtime.commands.train import InputError, check_inputs
from runtime.distributed.process_group import LaunchEnv
from tests.models.family_configs import SPECS, debug_config, family_id

# family -> case name -> (flags after --model <debug size> --steps 1, words the error line holds; None: accepted).
FLAG_CASES = {
    "llama3": {
        "mp-over-the-kv-heads": (["--mp", "4"], ["--mp 4", "key/value head count (--kv-heads 2)", "valid --mp values: 1, 2"]),
        "mp-over-as-many-kv-heads": (["--mp", "4", "--kv-heads", "4"], None),  # 4 heads over 4 key/value heads, 4 ways
        "kv-heads-not-dividing-heads": (["--kv-heads", "3"], ["--kv-heads 3", "--heads 4", "valid --kv-heads values: 1, 2, 4"]),
        "mlp-width-not-split": (["--mp", "2", "--heads", "8", "--kv-heads", "2", "--mlp-width", "101"],
                                ["--mp 2", "--mlp-width 101"]),
    },
    "qwen3": {
        "ep-on-a-dense-model": (["--dp", "2", "--ep", "2"], ["--ep 2", "qwen3", "mixture-of-experts"]),
        "mlp-width-not-split": (["--mp", "2", "--mlp-width", "101"], ["--mp 2", "--mlp-width 101"]),
    },
    "qwen3_moe": {
        "ep-over-dp": (["--dp", "2", "--ep", "4"], ["--ep 4", "--dp 2", "valid --ep values: 1, 2"]),
    },
    "mixtral": {
        "ep-not-dividing-experts": (["--dp", "6", "--ep", "3"], ["--ep 3", "8 experts", "valid --ep values: 1, 2"]),
        "mp-over-the-kv-heads": (["--mp", "4"], ["--mp 4", "key/value head count (--kv-heads 2)"]),
    },
    "deepseek_v3": {
        "mp-not-dividing-heads": (["--mp", "3"], ["--mp 3", "--heads 4", "valid --mp values: 1, 2, 4"]),
        "mlp-width-not-split": (["--heads", "8", "--mlp-width", "100", "--mp", "8"], ["--mp 8", "--mlp-width 100"]),
    },
}
CASES = [(family, name, *case) for family, cases in FLAG_CASES.items() for name, case in cases.items()]


def _check(model: str, flags: list[str]) -> None:
    """``check_inputs`` on rank 0 of a launch of as many ranks as --dp x --mp ask for."""
    sizes = {flag: int(flags[flags.index(flag) + 1]) if flag in flags else 1 for flag in ("--dp", "--mp")}
    nproc = sizes["--dp"] * sizes["--mp"]
    check_inputs(["--model", model, "--steps", "1", *flags],
                 LaunchEnv(rank=0, world_size=nproc, local_rank=0, local_world_size=nproc))


def _refusal(model: str, flags: list[str]) -> str:
    with pytest.raises(InputError) as raised:
        _check(model, flags)
    line = str(raised.value)
    assert "\n" not in line, line
    return line


def test_every_family_of_flag_cases_is_registered():
    assert set(FLAG_CASES) <= set(FAMILIES)


@pytest.mark.parametrize("spec", SPECS, ids=family_id)
def test_the_debug_size_passes_the_checks_on_two_tensor_parallel_ranks(spec):
    _check(spec.debug_size, ["--mp", "2"])
    _check(spec.debug_size, ["--mp", "2", "--sequence-parallel"])


@pytest.mark.parametrize("spec", SPECS, ids=family_id)
def test_an_mp_the_heads_do_not_split_into_is_refused_naming_the_flag(spec):
    heads = debug_config(spec).n_heads
    mp = next(m for m in range(2, heads + 2) if heads % m)
    line = _refusal(spec.debug_size, ["--mp", str(mp)])
    assert f"--mp {mp} must divide" in line and "valid --mp values: 1, 2" in line, line


@pytest.mark.parametrize(("family", "name", "flags", "words"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_the_checks_name_the_flag_before_any_process_group(family, name, flags, words):
    model = FAMILIES[family].debug_size
    if words is None:
        _check(model, flags)
        return
    line = _refusal(model, flags)
    assert all(w in line for w in words), line
