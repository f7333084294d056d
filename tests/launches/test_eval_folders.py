"""``run.py eval --init-from FOLDER`` reads every family's Hugging Face folder as ``train --init-from`` does (one
builder, one weight reader) and gives transformers' loss on the folder's fixed batch (expected.json ``loss``,
written by transformers itself), on one process and on a 2x2x2 mesh (experts split over --ep 2 where their count
allows), with training's layout flags (activation checkpointing, ZeRO-3) accepted.

Each of the batch's two rows is a token file of one window (T + 1 = 24 tokens); both rows predict 23 tokens, so
transformers' mean over the batch is the mean of the two evaluations. The mesh evaluates each family's plain folder
on the first row and gives one process's loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import spawn_ranks
from tests.paths import FIXTURE_ROOT
from tests.token_writers import write_nanogpt

FIXTURES = FIXTURE_ROOT / "hf-models"


def _family(folder: Path) -> str | None:
    """The registered family that reads ``folder`` (None: no family of the engine's reads it yet)."""
    from runtime.checkpoint.hf_weights import read_hf_model
    from runtime.checkpoint.safetensors import TensorFileError

    try:
        return read_hf_model(folder).spec.family
    except TensorFileError:
        return None


FAMILY_OF = {p.name: family for p in sorted(FIXTURES.iterdir())
             if (p / "expected.json").is_file() and (family := _family(p)) is not None}
FOLDERS = list(FAMILY_OF)
# The 2x2x2 mesh evaluates one folder per family (its first by name: the plain one, not a YaRN or quantized copy,
# which one process reads here and the mesh reads in tests/models/test_hf_fixtures*.py), on the batch's first row.
MESH_FOLDERS = list({family: name for name, family in reversed(FAMILY_OF.items())}.values())



def _evaluate_each(argvs: list[list[str]], out_dir: str) -> None:
    """One rank: ``run.py eval`` of each argv in turn (one process group for all), the results to ``out_dir``."""
    from runtime.commands import eval as eval_command
    from runtime.device import configure_cpu_threads, select_device
    from runtime.distributed.process_group import LaunchEnv, init_distributed, shutdown_distributed

    env = LaunchEnv.from_environ()
    device = select_device(env.local_rank, "cpu")
    configure_cpu_threads(env.local_world_size)
    init_distributed(env, device)
    for i, argv in enumerate(argvs):
        result = eval_command.evaluate(eval_command.check_inputs(argv, env), env=env, device=device)
        if env.rank == 0:
            Path(out_dir, f"eval{i}.json").write_text(json.dumps({"loss": result.loss, "tokens": result.tokens}))
    shutdown_distributed()


def _n_experts(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    return config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0


def _mesh(folder: Path, world: int) -> list[str]:
    if world == 1:
        return []
    experts = _n_experts(folder)
    ep = ["--ep", "2"] if experts and experts % 2 == 0 else []  # an odd expert count: FSDP over them alone
    # Training's layout flags are accepted: selective recomputation (no-op forward only), ZeRO-3 resharding.
    return ["--dp", "2", "--pp", "2", "--mp", "2", "--schedule", "1f1b", "--activation-checkpointing", "selective",
            "--reshard-after-forward", *ep]


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory) -> dict[tuple[str, int], list[float]]:
    root = tmp_path_factory.mktemp("eval_folders")
    keys, argvs = {1: [], 8: []}, {1: [], 8: []}
    for name in FOLDERS:
        for row, tokens in enumerate(json.loads((FIXTURES / name / "expected.json").read_text())["batch"]):
            data = write_nanogpt(root / f"{name}_{row}.bin", tokens)
            for world in argvs:
                if world > 1 and (name not in MESH_FOLDERS or row > 0):
                    continue
                argvs[world].append([*_mesh(FIXTURES / name, world), "--init-from", str(FIXTURES / name),
                                     "--data", str(data), "--data-format", "nanogpt", "--seq-len", str(len(tokens) - 1),
                                     "--micro-batch-size", "1"])
                keys[world].append((name, row))
    results = {}
    for world, runs in argvs.items():
        out = root / f"world{world}"
        out.mkdir()
        spawn_ranks(_evaluate_each, world_size=world, args=(runs, str(out)), timeout=900)
        for i, (name, row) in enumerate(keys[world]):
            report = json.loads((out / f"eval{i}.json").read_text())
            assert report["tokens"] == 23, report
            results.setdefault((name, world), []).append(report["loss"])
    return results


@pytest.mark.slow  # real multi-process jobs
@pytest.mark.parametrize("name", FOLDERS)
def test_eval_of_a_folder_gives_transformers_loss(evaluations, name):
    expected = json.loads((FIXTURES / name / "expected.json").read_text())["loss"]
    losses = evaluations[(name, 1)]
    assert sum(losses) / len(losses) == pytest.approx(expected, abs=1e-5, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", MESH_FOLDERS)
def test_eval_on_2x2x2_gives_the_one_process_loss(evaluations, name):
    """The mesh's loss on the first row is one process's (which transformers' loss checks above)."""
    assert evaluations[(name, 8)] == pytest.approx(evaluations[(name, 1)][:1], abs=1e-5, rel=1e-5)


def test_one_folder_per_family_is_evaluated_on_the_mesh():
    assert sorted(FAMILY_OF[name] for name in MESH_FOLDERS) == sorted(set(FAMILY_OF.values()))


def test_every_family_is_evaluated_from_a_folder():
    """A registered family gets this check by having a fixture folder."""
    from models import FAMILIES

    assert set(FAMILY_OF.values()) == set(FAMILIES)
