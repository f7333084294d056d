"""Checkpoints on real ranks: exact resume, resharding across meshes, export / --init-from, and bad
checkpoints (partial, corrupt, foreign) and a full disk. Training runs on spawned ranks (forked from a server
that imported the engine once) the way run.py runs them; the bad checkpoints go through torchrun and run.py.

One module-scoped set of runs feeds every test: A trains 20 steps on 2x2x2 uninterrupted; B trains the
same job, stops after step 10 (a checkpoint), and B2 resumes it for the last 10 steps.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from models import spec_of
from runtime.checkpoint.files import read_checkpoint, read_dcp_metadata, verify_files
from runtime.commands.flags import parse_train_config
from runtime.engine.data import build_data, inputs_and_targets
from tests.launch import QUICK_RUN, check_clean_failure, python_run, spawn_ranks, train_runs

pytestmark = [
    pytest.mark.slow,  # real multi-process jobs
    # Reading a checkpoint in the test process (no process group) makes DCP say so; that is intended.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

STEPS = 20
COMMON = ["--model", "tiny", "--precision", "fp32", "--steps", str(STEPS), "--micro-batch-size", "2", "--seq-len", "32",
          "--global-batch-size", "16", "--warmup-steps", "2", "--lr", "3e-3", "--log-every", "5", *QUICK_RUN]


def _mesh(dp, pp, mp) -> list[str]:
    return [f"--dp={dp}", f"--pp={pp}", f"--mp={mp}"]


def _train(mesh: tuple[int, int, int], logdir: Path, *flags: str) -> tuple[dict, str]:
    """Run to completion on a spawned job (what run.py does once launched); return summary.json and the
    combined output of every rank."""
    return _train_in_turn([(mesh, logdir, flags)])[0]


def _world(mesh: tuple[int, int, int], flags) -> int:
    return mesh[0] * mesh[1] * mesh[2] * (int(flags[flags.index("--cp") + 1]) if "--cp" in flags else 1)


def _train_in_turn(runs: list[tuple[tuple[int, int, int], Path, tuple[str, ...]]]) -> list[tuple[dict, str]]:
    """Runs of one world size, (mesh, logdir, flags) each, one after another on the same spawned ranks (a
    later run may resume an earlier one's checkpoint)."""
    (world,) = {_world(mesh, flags) for mesh, _, flags in runs}
    outputs = train_runs([[*_mesh(*mesh), *COMMON, "--logdir", str(logdir), *flags] for mesh, logdir, flags in runs],
                         world_size=world, outputs=[logdir / "output" for _, logdir, _ in runs],
                         timeout=120 + 120 * len(runs))
    return [(json.loads((logdir / "summary.json").read_text()), output) for (_, logdir, _), output in zip(runs, outputs)]


@dataclass
class Runs:
    root: Path
    a: dict  # 20 steps, uninterrupted; checkpoints at 5, 10, 15 and 20 in root/a
    b1: dict  # the same job with --async-checkpoint stopped after step 10; checkpoints 5, 10 in root/b
    b2: dict  # B resumed with --resume (and --async-checkpoint) for steps 11-20; checkpoints 15, 20 in root/b
    b1_output: str


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("resume")
    ckpt = lambda name: ["--checkpoint-dir", str(root / name), "--checkpoint-every", "5", "--keep-checkpoints", "4"]  # noqa: E731
    (a, _), (b1, b1_output), (b2, _) = _train_in_turn([
        ((2, 2, 2), root / "log_a", ckpt("a")),
        ((2, 2, 2), root / "log_b1", (*ckpt("b"), "--async-checkpoint", "--stop-at-step", "10")),
        ((2, 2, 2), root / "log_b2", (*ckpt("b"), "--async-checkpoint", "--resume"))])
    return Runs(root, a, b1, b2, b1_output)


def _all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model and optimizer state), unsharded, read in this process."""
    import torch.distributed.checkpoint as dcp

    state = {key: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in read_dcp_metadata(folder).state_dict_metadata.items()
             if isinstance(md, TensorStorageMetadata) and not key.startswith("rng.")}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    return state


# --- resume and resharding --------------------------------------------------------------------------------

def test_stopped_and_resumed_run_matches_the_uninterrupted_run(runs):
    assert runs.b1["losses"] == runs.a["losses"][:10]
    assert runs.b2["start_step"] == 10 and len(runs.b2["losses"]) == 10
    for step, (got, want) in enumerate(zip(runs.b2["losses"], runs.a["losses"][10:]), start=11):
        assert abs(got - want) <= 1e-6, f"step {step}: resumed loss {got} vs uninterrupted {want}"
    final_a, final_b = _all_tensors(runs.root / "a" / "step-000020"), _all_tensors(runs.root / "b" / "step-000020")
    assert set(final_a) == set(final_b)
    assert any(k.endswith(".exp_avg_sq") for k in final_a) and any(k.endswith(".step") for k in final_a)
    for key in sorted(final_a):  # weights and AdamW state, bit for bit
        assert torch.equal(final_a[key], final_b[key]), key
    assert float(final_b["optim.head.weight.step"]) == STEPS


def test_background_checkpoints_hold_the_state_of_their_step(runs):
    """B's checkpoints of steps 5 and 15 were written in the background while the next steps updated the
    weights in place: they must still equal A's, written in the foreground, bit for bit."""
    assert "step 5: checkpoint staged in" in runs.b1_output and "writing in the background" in runs.b1_output
    assert [Path(p).name for p in runs.b1["checkpoints"]] == ["step-000005", "step-000010"]
    assert set(runs.b1["checkpoint_pauses_s"]) == {"5", "10"}
    for step in (5, 10, 15):
        sync, background = (_all_tensors(runs.root / run / f"step-{step:06d}") for run in ("a", "b"))
        assert set(sync) == set(background)
        for key in sorted(sync):
            assert torch.equal(sync[key], background[key]), (step, key)


# (dp, pp, mp), extra flags: other shapes, a different number of stages, and activation checkpointing
# (whose wrapper must not change the names).
RESHARD_TARGETS = [
    ((1, 2, 4), ["--schedule", "1f1b"]),
    ((4, 2, 1), ["--activation-checkpointing"]),
    ((2, 1, 2), []),
    ((1, 1, 1), []),
]


@pytest.mark.parametrize("mesh,extra", RESHARD_TARGETS, ids=[f"{d}x{p}x{m}" for (d, p, m), _ in RESHARD_TARGETS])
def test_a_2x2x2_checkpoint_continues_on_another_mesh(runs, tmp_path, mesh, extra):
    summary, output = _train(mesh, tmp_path, "--resume-from", str(runs.root / "b" / "step-000010"),
                             "--stop-at-step", "12", *extra)
    assert "resharding: saved on (dp, pp, mp) = (2, 2, 2)" in output
    assert summary["start_step"] == 10 and len(summary["losses"]) == 2
    # Step 11's loss checks the weights; step 12's also the update of step 11, i.e. the AdamW state and
    # learning rate. Only the reduction order differs across meshes (about 3e-8 relative, measured).
    for got, want in zip(summary["losses"], runs.a["losses"][10:12]):
        assert got == pytest.approx(want, rel=1e-6)


def test_checkpoints_move_between_looped_and_v_placements(runs, tmp_path):
    """A checkpoint of the default (looped, interleaved) schedule continues under ZB-V, whose V places
    the stages differently (rank 0 holds the first and the last); ZB-V's own checkpoint then continues
    under breadth-first looping on another mesh. Only names are saved, so neither layout matters."""
    v_dir = tmp_path / "v"
    v_run, _ = _train((2, 2, 2), tmp_path / "log_v", "--resume-from", str(runs.root / "b" / "step-000010"),
                      "--schedule", "zbv", "--checkpoint-dir", str(v_dir), "--checkpoint-every", "2",
                      "--stop-at-step", "12")
    looped, output = _train((1, 2, 2), tmp_path / "log_looped", "--resume-from", str(v_dir / "step-000012"),
                            "--schedule", "looped-bfs", "--stop-at-step", "14")
    assert "resharding: saved on (dp, pp, mp) = (2, 2, 2)" in output and looped["start_step"] == 12
    for got, want in zip(v_run["losses"] + looped["losses"], runs.a["losses"][10:14]):
        assert got == pytest.approx(want, rel=1e-6)


def test_a_llama_checkpoint_of_2x2x1_resumes_on_1x1x4_exactly(tmp_path):
    """Llama 3 (GQA, RoPE, RMSNorm, a tied head) through the same names-only checkpoints: 2x2x1 (FSDP and PP, no
    TP) saves at step 3, 1x1x4 (TP over 4 ranks: 2 query heads and 1 kv head each) continues."""
    llama = ["--model", "llama3-debug", "--layers", "4", "--heads", "8", "--kv-heads", "4", "--steps", "6"]
    (a, _), (resumed, output) = _train_in_turn([
        ((2, 2, 1), tmp_path / "log_a", (*llama, "--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "3")),
        ((1, 1, 4), tmp_path / "log_b", (*llama, "--schedule", "1f1b", "--resume-from", str(tmp_path / "a" / "step-000003")))])
    assert "resharding: saved on (dp, pp, mp) = (2, 2, 1)" in output and resumed["start_step"] == 3
    assert len(resumed["losses"]) == 3
    for got, want in zip(resumed["losses"], a["losses"][3:]):
        assert got == pytest.approx(want, rel=1e-6)


def test_an_expert_parallel_checkpoint_resumes_on_other_ep_and_cp_exactly(tmp_path):
    """Mixtral's experts, stacked [E, ...] and sharded by expert over --ep 2 (and by FSDP over the other replicas),
    with the routers' selection biases: 4x1x1 ep 2 saves at step 3; 4x1x1 ep 4 continues exactly, and so does
    one replica whose sequences are split over 2 context-parallel ranks (1x1x1 --cp 2: no expert parallelism)."""
    moe = ["--model", "mixtral-debug", "--steps", "6", "--micro-batch-size", "1", "--expert-bias-rate", "0.01"]
    resume = ("--resume-from", str(tmp_path / "a" / "step-000003"))
    (a, _), ep4 = _train_in_turn([
        ((4, 1, 1), tmp_path / "log_a", (*moe, "--ep", "2", "--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "3")),
        ((4, 1, 1), tmp_path / "log_ep4", (*moe, "--ep", "4", *resume))])
    for resumed, output in (ep4, _train((1, 1, 1), tmp_path / "log_cp2", *moe, "--cp", "2", *resume)):
        assert "resharding: saved on (dp, pp, mp) = (4, 1, 1), ep 2" in output and resumed["start_step"] == 3
        for got, want in zip(resumed["losses"], a["losses"][3:], strict=True):
            assert got == pytest.approx(want, rel=1e-6)


def test_a_checkpoint_with_mtp_depths_resumes_on_another_mesh_exactly(tmp_path):
    """Llama 3 with two MTP depths: 1x2x2 (the depths on the last stage, their embedding a third copy of the tied one,
    TP) saves at step 3; 4x1x1 (one stage: the three names share one Parameter) continues, the depths' losses too."""
    llama = ["--model", "llama3-debug", "--layers", "4", "--heads", "8", "--kv-heads", "4", "--steps", "6",
             "--mtp-depth", "2"]
    (a, _), (resumed, output) = _train_in_turn([
        ((1, 2, 2), tmp_path / "log_a", (*llama, "--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "3")),
        ((4, 1, 1), tmp_path / "log_b", (*llama, "--schedule", "1f1b", "--resume-from", str(tmp_path / "a" / "step-000003")))])
    assert "resharding: saved on (dp, pp, mp) = (1, 2, 2)" in output and resumed["start_step"] == 3
    for key in ("losses", "mtp_losses"):
        assert len(resumed[key]) == 3
        for got, want in zip(resumed[key], a[key][3:]):
            assert got == pytest.approx(want, rel=1e-6)


# --- export and --init-from -------------------------------------------------------------------------------

def test_export_writes_full_tensors_that_start_a_run_on_another_mesh(runs, tmp_path):
    out = tmp_path / "model.pt"
    result = python_run(["export", "--checkpoint", str(runs.root / "b" / "step-000010"), "--out", str(out)], timeout=120)
    assert result.returncode == 0, result.stderr
    cfg = parse_train_config([*_mesh(1, 2, 1), *COMMON], world_size=2)
    model = spec_of(cfg.model).build(cfg.model)
    model.load_state_dict(torch.load(out, weights_only=True))  # strict: every name, every shape

    # The first step from the export on 2 context-parallel ranks (each its chunks of every sequence) sees
    # exactly these weights: its loss is their loss.
    summary, _ = _train((1, 1, 1), tmp_path / "log", "--cp", "2", "--init-from", str(out), "--stop-at-step", "1")
    data = build_data("builtin", vocab_size=256, seq_len=32, global_batch_size=16, seed=cfg.seed, val_fraction=0.1)
    inputs, targets = inputs_and_targets(data.train.rows(0, 0, 16))
    with torch.no_grad():
        want = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()
    assert summary["losses"][0] == pytest.approx(want, rel=1e-5)


# --- bad checkpoints --------------------------------------------------------------------------------------

def _copy(runs: Runs, tmp_path: Path, step: int = 10) -> Path:
    return Path(shutil.copytree(runs.root / "b" / f"step-{step:06d}", tmp_path / f"step-{step:06d}"))


def _shard(folder: Path) -> Path:
    return sorted(folder.glob("*.distcp"))[-1]


def _resume_from(folder: Path, *flags: str) -> list[str]:
    return [*_mesh(1, 2, 1), *COMMON, "--resume-from", str(folder), "--logdir", str(folder.parent / "log"), *flags]


def test_a_partial_checkpoint_is_an_error_naming_the_missing_file(runs, tmp_path):
    folder = _copy(runs, tmp_path)
    (folder / ".metadata").unlink()  # the crash came before rank 0 wrote DCP's metadata
    check_clean_failure(2, _resume_from(folder), [f"checkpoint {folder} is partial", f"{folder}/.metadata is missing"])


def test_a_truncated_shard_is_an_error_naming_the_file(runs, tmp_path):
    folder = _copy(runs, tmp_path)
    shard = _shard(folder)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    check_clean_failure(2, _resume_from(folder), [f"{shard} is truncated", "the manifest says"])


def test_a_corrupted_shard_is_caught_before_anything_is_loaded(runs, tmp_path):
    folder = _copy(runs, tmp_path)
    shard = _shard(folder)
    data = bytearray(shard.read_bytes())
    data[-50] ^= 0xFF  # inside a tensor's bytes: DCP itself would load it without complaint
    shard.write_bytes(bytes(data))
    check_clean_failure(2, _resume_from(folder), [f"{shard} does not match the sha256"], max_seconds=90)


def test_a_checkpoint_of_another_model_shape_is_refused(runs, tmp_path):
    folder = runs.root / "b" / "step-000010"
    check_clean_failure(2, _resume_from(folder, "--d-model", "32"),
                        [f"checkpoint {folder} holds a different model shape", "--d-model 64 in the checkpoint, 32"])


def test_resume_passes_over_a_partial_checkpoint_and_allows_a_new_global_batch(runs, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(runs.root / "b" / "step-000010", directory / "step-000010")
    partial = Path(shutil.copytree(runs.root / "b" / "step-000020", directory / "step-000020"))
    (partial / "checkpoint.json").unlink()  # crashed after DCP finished, before the manifest
    (directory / "latest").write_text("step-000020\n")
    summary, output = _train((1, 2, 1), tmp_path / "log", "--global-batch-size", "8", "--checkpoint-dir",
                             str(directory), "--resume", "--stop-at-step", "11")
    assert f"ignoring checkpoint {partial} is partial" in output
    assert "warning: the global batch size changed from 16 to 8" in output
    assert summary["start_step"] == 10 and summary["config"]["plan"]["microbatches"] == 4
    assert (directory / "latest").read_text().strip() == "step-000011"


# --- a full disk during a save ----------------------------------------------------------------------------

FULL_DISK_RANK = 1


def _fill_disk_on_the_save_of_step_4() -> None:
    """On FULL_DISK_RANK, writing a shard of step 4's checkpoint fails like a full disk (whichever thread
    writes it: the training thread, or --async-checkpoint's background one)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    if int(os.environ["RANK"]) != FULL_DISK_RANK:
        return
    create_stream = FileSystem.create_stream

    @contextlib.contextmanager
    def full_disk_stream(self, path, mode):
        with create_stream(self, path, mode) as stream:
            if "w" in mode and str(path).endswith(".distcp") and "step-000004" in str(path):
                stream.write(b"\0" * 64)  # a partial shard, then the disk is full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            yield stream

    FileSystem.create_stream = full_disk_stream


def _train_and_record(argv, out_dir) -> None:
    import run

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        _fill_disk_on_the_save_of_step_4()
        code = run.main(argv)
    Path(out_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps({"code": code, "stderr": err.getvalue()}))


@pytest.mark.parametrize("mode", [[], ["--async-checkpoint"]], ids=["foreground", "background"])
def test_a_full_disk_stops_training_and_keeps_the_previous_checkpoint(tmp_path, mode):
    directory = tmp_path / "ckpt"
    argv = [*_mesh(2, 1, 1), *COMMON, "--steps", "6", "--checkpoint-dir", str(directory), "--checkpoint-every", "2",
            "--logdir", str(tmp_path / "log"), *mode]
    spawn_ranks(functools.partial(_train_and_record, out_dir=str(tmp_path)), world_size=2, args=(argv,), timeout=240)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["code"] for r in results] == [1, 1], results
    error = [line for line in results[0]["stderr"].splitlines() if line.startswith("error:")]
    assert len(error) == 1, results[0]["stderr"]
    for words in ("could not save the checkpoint of step 4", f"rank {FULL_DISK_RANK}", "No space left on device",
                  f"the previous checkpoint {directory / 'step-000002'} is intact"):
        assert words in error[0], error[0]
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-000002"]  # no half-written folder left
    info = read_checkpoint(directory / "step-000002")
    assert verify_files(info, sorted(info.files)) == []
    assert "model.head.weight" in _all_tensors(info.path)  # and DCP loads it
