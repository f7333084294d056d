"""Checkpoint folders: partial, corrupt and foreign detection, the latest marker, publishing and pruning.

These build real DCP folders in one process; tests/launches/test_checkpoint.py runs the same cases through
torchrun with checkpoints written by real ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from models import build_model, config_from_dict, named_config
from runtime.checkpoint.files import (
    CheckpointError,
    PartialCheckpointError,
    check_same_model,
    check_writable_dir,
    dcp_index,
    describe_file,
    find_latest,
    prune,
    publish,
    published_steps,
    read_checkpoint,
    read_dcp_metadata,
    resume_notes,
    tmp_folder,
    verify_files,
    write_manifest,
)
from runtime.commands.flags import parse_train_config

# dcp.save without a process group says so once per save; that is what these tests intend.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TINY = named_config("tiny", seq_len=32)


def _config(*flags) -> dict:
    return parse_train_config(["--seq-len", "32", *flags], world_size=1).to_dict()


def _save(directory: Path, step: int, *, keep: int = 3, model=TINY, indexed: bool = True) -> Path:
    """A checkpoint laid out as runtime/checkpoint/saving.py writes one, from a single process; ``indexed``:
    with the manifest's index of DCP's metadata (without: as checkpoints written before the index)."""
    tmp = tmp_folder(directory, step)
    weights = {name: p.detach() for name, p in build_model(model, seed=step).named_parameters(remove_duplicate=False)}
    dcp.save({"model": weights}, checkpoint_id=tmp, no_dist=True)
    files = {p.name: describe_file(p) for p in tmp.iterdir()}
    config = _config() if model == TINY else _config("--d-model", str(model.d_model))
    # The metadata as written: torch 2.11's dcp.save returns it without storage_data.
    index = dcp_index(read_dcp_metadata(tmp)) if indexed else None
    write_manifest(tmp, step=step, config=config, files=files, index=index)
    final = publish(tmp, directory, step)
    prune(directory, keep=keep, protect=final).join()
    return final


def _shard(folder: Path) -> Path:
    return next(p for p in folder.iterdir() if p.suffix == ".distcp")


def test_a_published_checkpoint_reads_back(tmp_path):
    folder = _save(tmp_path, 10)
    info = read_checkpoint(folder)
    assert (info.step, info.path) == (10, folder)
    assert verify_files(info, sorted(info.files)) == []
    check_same_model(info, TINY)
    assert (tmp_path / "latest").read_text() == "step-000010\n"


@pytest.mark.parametrize("missing", [".metadata", "checkpoint.json"])
def test_a_folder_without_metadata_or_manifest_is_partial(tmp_path, missing):
    folder = _save(tmp_path, 10)
    (folder / missing).unlink()
    with pytest.raises(PartialCheckpointError, match=f"partial .*{missing}"):
        read_checkpoint(folder)


def test_an_unpublished_temporary_folder_is_partial(tmp_path):
    folder = _save(tmp_path, 10)
    os.rename(folder, tmp_path / ".tmp-step-000010")
    with pytest.raises(PartialCheckpointError, match="never published"):
        read_checkpoint(tmp_path / ".tmp-step-000010")


def test_a_truncated_shard_is_corrupt_and_named(tmp_path):
    folder = _save(tmp_path, 10)
    shard = _shard(folder)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=f"corrupted: {shard} is truncated"):
        read_checkpoint(folder)


def test_a_flipped_byte_fails_the_hash_check(tmp_path):
    folder = _save(tmp_path, 10)
    shard = _shard(folder)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    info = read_checkpoint(folder)  # same size: only the content hash can tell
    assert verify_files(info, sorted(info.files)) == [
        f"checkpoint {folder} is corrupted: {shard} does not match the sha256 recorded when it was written"]


def test_a_garbled_manifest_is_corrupt(tmp_path):
    folder = _save(tmp_path, 10)
    (folder / "checkpoint.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="checkpoint.json is corrupted"):
        read_checkpoint(folder)


def test_a_checkpoint_of_another_model_shape_is_foreign(tmp_path):
    folder = _save(tmp_path, 10, model=dataclasses.replace(TINY, d_model=32, mlp_width=128))
    with pytest.raises(CheckpointError, match="different model shape: --d-model 32 in the checkpoint, 64 in this run"):
        check_same_model(read_checkpoint(folder), TINY)


def test_a_checkpoint_recorded_before_the_model_had_a_context_still_fits_its_model(tmp_path):
    # GPT-2 configs recorded before n_positions existed: their position table had seq_len rows.
    folder = _save(tmp_path, 10)
    manifest = json.loads((folder / "checkpoint.json").read_text())
    del manifest["config"]["model"]["n_positions"]
    info = dataclasses.replace(read_checkpoint(folder), config=manifest["config"])
    check_same_model(info, TINY)
    assert config_from_dict(manifest["config"]["model"]) == TINY and TINY.n_positions == 32
    with pytest.raises(CheckpointError, match="the model's context \\(n_positions\\) 32 in the checkpoint, 64"):
        check_same_model(info, dataclasses.replace(TINY, n_positions=64))


@pytest.mark.parametrize("indexed", [True, False], ids=["index", "metadata"])
def test_tensor_shapes_are_checked_even_if_the_manifest_matches(tmp_path, indexed):
    folder = _save(tmp_path, 10, model=dataclasses.replace(TINY, vocab_size=300), indexed=indexed)
    info = dataclasses.replace(read_checkpoint(folder), config=_config())
    with pytest.raises(CheckpointError, match=r"parameter head.weight has shape \(300, 64\)"):
        check_same_model(info, TINY)


def test_the_checks_before_the_process_group_read_only_the_manifest(tmp_path, monkeypatch):
    """Every rank runs them: DCP's .metadata (which grows with the number of tensor chunks) is not unpickled;
    its index in the manifest answers for it. A checkpoint without the index still reads its .metadata."""
    import runtime.checkpoint.files as files_module

    indexed, old = _save(tmp_path / "new", 10), _save(tmp_path / "old", 10, indexed=False)
    reads = []
    real = files_module.read_dcp_metadata
    monkeypatch.setattr(files_module, "read_dcp_metadata", lambda path: reads.append(Path(path)) or real(path))
    check_same_model(read_checkpoint(indexed), TINY)
    assert reads == []
    check_same_model(read_checkpoint(old), TINY)
    assert set(reads) == {old}
    assert read_checkpoint(old).index is None and read_checkpoint(indexed).index == dcp_index(real(indexed))


def test_an_index_that_does_not_fit_the_shards_is_corrupt(tmp_path):
    folder = _save(tmp_path, 10)
    manifest = json.loads((folder / "checkpoint.json").read_text())
    shard = next(iter(manifest["dcp_index"]["extents"]))
    manifest["dcp_index"]["extents"][shard] = manifest["files"][shard]["bytes"] + 1
    (folder / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"{folder / shard} holds .* bytes, .*needs"):
        read_checkpoint(folder)


def test_resume_passes_over_a_partial_newest_checkpoint(tmp_path):
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    (newest / ".metadata").unlink()  # e.g. the marker was updated by hand, or a copy was interrupted
    info, notes = find_latest(tmp_path)
    assert info.step == 10
    assert len(notes) == 1 and "ignoring checkpoint" in notes[0] and "partial" in notes[0]


def test_resume_never_skips_a_corrupt_checkpoint(tmp_path):
    _save(tmp_path, 10)
    shard = _shard(_save(tmp_path, 20))
    with open(shard, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match="truncated"):
        find_latest(tmp_path)


def test_publishing_keeps_the_newest_k_and_removes_abandoned_saves(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step, keep=2)
    tmp_folder(tmp_path, 8).mkdir()  # a crashed save
    _save(tmp_path, 10, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000006", "step-000010"]


def test_pruning_hides_old_checkpoints_at_once_and_deletes_them_in_the_background(tmp_path, monkeypatch):
    """The caller (rank 0, after every rank agreed on the publish) returns before any file is unlinked;
    readers never see the doomed checkpoints again, and a deletion cut short is finished by the next prune."""
    import shutil
    import threading

    for step in (2, 4):
        _save(tmp_path, step)
    release, real_rmtree = threading.Event(), shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda path, **kw: release.wait(30) and real_rmtree(path, **kw))
    deleting = prune(tmp_path, keep=1, protect=tmp_path / "step-000004")
    assert deleting.is_alive()  # still waiting to unlink
    assert published_steps(tmp_path) == [4] and find_latest(tmp_path)[0].step == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [".deleting-step-000002", "latest", "step-000004"]
    release.set()
    deleting.join(timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004"]


def test_publishing_over_an_existing_step_replaces_it(tmp_path):
    _save(tmp_path, 10)
    folder = _save(tmp_path, 10)
    assert read_checkpoint(folder).step == 10 and not list(tmp_path.glob(".old-*"))


def test_an_unwritable_checkpoint_dir_is_refused(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(CheckpointError, match="not a folder"):
        check_writable_dir(a_file)
    with pytest.raises(CheckpointError, match="cannot write there"):
        check_writable_dir(Path("/proc/hybrid-engine-checkpoints"))  # even root cannot create folders in /proc


def test_resume_notes_warn_about_a_changed_global_batch():
    saved = _config("--micro-batch-size", "2", "--microbatches", "4")
    same = resume_notes(saved, saved, path=Path("c"), step=5)
    assert not [n for n in same if n.startswith("warning")]
    changed = resume_notes(saved, _config("--micro-batch-size", "2", "--microbatches", "8"), path=Path("c"), step=5)
    assert any(n.startswith("warning: the global batch size changed from 8 to 16") for n in changed)
