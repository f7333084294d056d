"""Checkpoint folders on disk: names, the ``latest`` marker, publishing, pruning, and validation.

Nothing here needs a process group, so every check that can be made before ranks start talking is
made here, on every rank alike, and bad input ends the job with one clear line.

A checkpoint directory looks like::

    DIR/latest                  "step-000020": the newest complete checkpoint (replaced atomically)
    DIR/step-000010/            published checkpoints (kept: the newest --keep-checkpoints)
    DIR/step-000020/
        .metadata               DCP's index of every tensor chunk (written by rank 0 once all ranks are done)
        __0_0.distcp ...        one shard file per rank
        checkpoint.json         our manifest: step, config, mesh, every file's size and sha256, and an
                                index of .metadata (each shard file's extent, each parameter's shape)
    DIR/.tmp-step-000030/       a save in progress, or one that crashed: never read
    DIR/.deleting-step-000005/  an old checkpoint being deleted in the background: never read

The checks made before any process group exists read only the manifest (every rank reads it): DCP's
``.metadata`` grows with the number of tensor chunks, and N ranks unpickling it at start-up is N times
the work; it is read once the ranks can share the work, by DCP's load (after the hash check).
Checkpoints written before the index existed fall back to reading ``.metadata``.

A folder is *partial* (a crash during the save) if it was never published or lacks ``.metadata`` or
``checkpoint.json``; ``--resume`` passes over it to the previous complete one. It is *corrupt* if a
file is missing, shorter or longer than the manifest says, or its bytes hash differently: always an
error naming the file. It is *foreign* if it holds a different model: an error naming the field.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from compiler.lora import LoraConfig
from compiler.parallel_plan import plan_of_run
from compiler.parallelize.lora import lora_parameter_shapes
from models import config_from_dict, config_to_dict
from runtime.atomic import write_text

MANIFEST = "checkpoint.json"
MARKER = "latest"
DCP_METADATA = ".metadata"
FORMAT = 1
_STEP_FOLDER = re.compile(r"^step-(\d+)$")
_DELETING = ".deleting-"

# Model config field -> the flag that sets it, for error messages.
_MODEL_FLAGS = {"family": "--model (family)", "n_kv_heads": "--kv-heads", "n_layers": "--layers", "d_model": "--d-model",
                "n_heads": "--heads", "seq_len": "--seq-len", "vocab_size": "--vocab-size", "mlp_width": "--mlp-width",
                "tie_embeddings": "tied embeddings (--untie-embeddings)",
                "n_positions": "the model's context (n_positions)",
                "max_position_embeddings": "the model's context (max_position_embeddings)",
                "mtp_depth": "--mtp-depth"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file and the problem."""


class PartialCheckpointError(CheckpointError):
    """A checkpoint whose save never finished (no DCP metadata or manifest, or never published)."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int  # optimizer steps completed when it was saved
    config: dict  # TrainConfig.to_dict() of the run that saved it
    files: dict[str, dict]  # file name -> {"bytes": int, "sha256": str}
    index: dict | None = None  # dcp_index() of its .metadata; None in checkpoints older than the index


def step_folder(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:06d}"


def tmp_folder(directory: Path, step: int) -> Path:
    return Path(directory) / f".tmp-step-{step:06d}"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def describe_file(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


# --- reading and validating -------------------------------------------------------------------------------

def read_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Structural checks that need no process group: complete, every file present at its recorded size,
    DCP metadata readable and within the files. Content hashes are checked later (``verify_files``),
    spread over the ranks."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such folder")
    if path.name.startswith(".tmp-"):
        raise PartialCheckpointError(f"checkpoint {path} is partial: its save never finished (it was never published)")
    for name in (DCP_METADATA, MANIFEST):
        if not (path / name).is_file():
            raise PartialCheckpointError(f"checkpoint {path} is partial (crash during save?): {path / name} is missing")
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        step, config, files, index = int(manifest["step"]), manifest["config"], manifest["files"], manifest.get("dcp_index")
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: {manifest_path} is corrupted ({e})") from None
    for name, expected in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is corrupted: {file} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            problem = "truncated" if size < expected["bytes"] else "longer than written"
            raise CheckpointError(f"checkpoint {path} is corrupted: {file} is {problem} "
                                  f"({size:,} bytes, the manifest says {expected['bytes']:,})")
    extents = index["extents"] if index else dcp_index(read_dcp_metadata(path))["extents"]
    for name, needed in sorted(extents.items()):
        if name not in files:
            raise CheckpointError(f"checkpoint {path} is corrupted: {path / DCP_METADATA} refers to {name}, "
                                  f"which the manifest does not list")
        if files[name]["bytes"] < needed:
            raise CheckpointError(f"checkpoint {path} is corrupted: {path / name} holds {files[name]['bytes']:,} "
                                  f"bytes, {path / DCP_METADATA} needs {needed:,}")
    return CheckpointInfo(path, step, config, files, index)


def read_dcp_metadata(path: Path):
    file = Path(path) / DCP_METADATA
    try:
        with open(file, "rb") as f:
            return pickle.load(f)
    except Exception as e:  # unpickling garbage can raise almost anything
        raise CheckpointError(f"checkpoint {path} is corrupted: cannot read {file} ({type(e).__name__}: {e})") from None


def dcp_index(metadata) -> dict:
    """What the checks before any process group need from DCP's metadata, small enough for the manifest:
    the bytes each shard file must hold (the end of the last item placed in it), every model parameter's
    shape, and how many ranks saved an RNG state."""
    extents: dict[str, int] = {}
    for info in metadata.storage_data.values():
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
    keys = metadata.state_dict_metadata
    shapes = {k.removeprefix("model."): list(md.size) for k, md in keys.items() if k.startswith("model.")}
    return {"extents": extents, "shapes": shapes, "rng_ranks": sum(k.startswith("rng.rank") for k in keys)}


def verify_files(info: CheckpointInfo, names: list[str]) -> list[str]:
    """Hash ``names`` (a share of the checkpoint's files) against the manifest; return the problems."""
    problems = []
    for name in names:
        if file_sha256(info.path / name) != info.files[name]["sha256"]:
            problems.append(f"checkpoint {info.path} is corrupted: {info.path / name} does not match the sha256 "
                            f"recorded when it was written")
    return problems


def check_same_model(info: CheckpointInfo, model, lora: LoraConfig | None = None) -> None:
    """A checkpoint of another model shape (or other LoRA adapters) is an error naming the differing fields and
    flags."""
    # Read back through the family's config (models.config_from_dict), so fields added since a checkpoint was
    # written take the values its model had (a GPT-2 config without n_positions: a table of seq_len rows;
    # one without a family: GPT-2, as every checkpoint before families existed).
    saved, ours = config_to_dict(config_from_dict(info.config.get("model", {}))), config_to_dict(model)
    diffs = [f"{_MODEL_FLAGS.get(k, k)} {saved.get(k)} in the checkpoint, {ours[k]} in this run"
             for k in ours if saved.get(k) != ours[k]]
    if diffs:
        raise CheckpointError(f"checkpoint {info.path} holds a different model shape: " + "; ".join(diffs))
    # The manifest could match while the tensors do not (an edited or mixed-up folder): check them too.
    expected = expected_parameter_shapes(model, lora)
    index = info.index or dcp_index(read_dcp_metadata(info.path))
    saved_shapes = {name: tuple(shape) for name, shape in index["shapes"].items()}
    for name in sorted(set(expected) | set(saved_shapes)):
        if expected.get(name) != saved_shapes.get(name):
            raise CheckpointError(f"checkpoint {info.path} does not fit this model: parameter {name} has shape "
                                  f"{saved_shapes.get(name, 'missing')} in {info.path / DCP_METADATA}, this model "
                                  f"needs {expected.get(name, 'no such parameter')}")


def expected_parameter_shapes(model, lora: LoraConfig | None = None) -> dict[str, tuple[int, ...]]:
    """Every parameter a checkpoint of ``model`` holds (both copies of a tied weight, LoRA's adapters) and its shape."""
    return lora_parameter_shapes(model, lora)


# --- finding the checkpoint to resume from ----------------------------------------------------------------

def published_steps(directory: Path) -> list[int]:
    """Steps of the published ``step-N`` folders, ascending (complete or not)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _STEP_FOLDER.match(p.name)) and p.is_dir())


def find_latest(directory: Path) -> tuple[CheckpointInfo | None, list[str]]:
    """The newest complete checkpoint in ``directory`` and notes on the partial ones passed over.

    The marker names the newest published checkpoint; if it is missing or names a partial folder,
    the newest complete ``step-N`` wins. Corrupt checkpoints are errors, never skipped.
    """
    directory, notes = Path(directory), []
    candidates = [step_folder(directory, s) for s in reversed(published_steps(directory))]
    marker = directory / MARKER
    if marker.is_file():
        named = directory / marker.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    for candidate in candidates:
        try:
            return read_checkpoint(candidate), notes
        except PartialCheckpointError as e:
            notes.append(f"ignoring {e}")
    return None, notes


@dataclass(frozen=True)
class StartPoint:
    """Where training starts: a checkpoint to resume, weights to initialise from, or scratch."""

    resume: CheckpointInfo | None
    init_from: Path | None
    notes: list[str]  # warnings and information for rank 0 to print


def resolve_start(cfg, *, model, run_config: dict, lora: LoraConfig | None = None) -> StartPoint:
    """Check the checkpoint flags against the filesystem; raise CheckpointError on anything unusable.

    ``cfg`` is the run's CheckpointConfig; ``run_config`` its whole config as a dict (what a checkpoint
    records), to say what differs from the checkpoint's run.
    """
    if cfg.dir is not None:
        check_writable_dir(Path(cfg.dir))
    notes: list[str] = []
    info = None
    if cfg.resume:
        info, notes = find_latest(Path(cfg.dir))
        if info is None:
            notes.append(f"--resume: no complete checkpoint in {cfg.dir} yet; starting from step 0")
    elif cfg.resume_from:
        path = Path(cfg.resume_from)
        if not path.exists():
            raise CheckpointError(f"--resume-from {path}: no such checkpoint folder")
        if (path / MARKER).is_file() or (published_steps(path) and not (path / MANIFEST).exists()):
            info, notes = find_latest(path)  # a checkpoint directory: take its latest
            if info is None:
                raise CheckpointError(f"--resume-from {path}: no complete checkpoint in this folder")
        else:
            info = read_checkpoint(path)
    if info is not None:
        check_same_model(info, model, lora)
        notes += resume_notes(info.config, run_config, path=info.path, step=info.step)
    init_from = None
    if cfg.init_from:
        init_from = Path(cfg.init_from)
        if not init_from.exists():
            raise CheckpointError(f"--init-from {init_from}: no such file or folder (a single-file export of "
                                  f"`run.py export`, or a Hugging Face model folder)")
        if info is not None:  # a restart: the checkpoint's weights, not the starting ones
            notes.append(f"--init-from {init_from}: its weights are not read, the run continues from {info.path}")
            init_from = None
    return StartPoint(info, init_from, notes)


def resume_notes(saved: dict, current: dict, *, path: Path, step: int) -> list[str]:
    """What a resumed run should be told: resharding, and settings that make it a different run. ``saved`` and
    ``current`` are runs' configs (``TrainConfig.to_dict()``; a checkpoint of an older version keeps its layout in
    separate mesh / pipeline fields, which ``plan_of_run`` reads too)."""
    notes = [f"resuming from {path} (step {step})"]
    was, now = plan_of_run(saved), plan_of_run(current)
    def mesh(p) -> str:
        return f"({p.dp}, {p.pp}, {p.mp})" + "".join(f", {k} {getattr(p, k)}" for k in ("cp", "ep") if getattr(p, k) > 1)
    if mesh(was) != mesh(now):
        notes.append(f"resharding: saved on (dp, pp, mp) = {mesh(was)}, loading on {mesh(now)}")
    if was.global_batch_size != now.global_batch_size:
        notes.append(f"warning: the global batch size changed from {was.global_batch_size} to "
                     f"{now.global_batch_size}; batches from step {step + 1} on are drawn at the new size, "
                     f"so the run no longer continues the saved one exactly")
    if was.precision != now.precision:
        notes.append(f"warning: --precision changed from {was.precision} to {now.precision}")
    saved_tokenizer, tokenizer = saved.get("data", {}).get("tokenizer"), current["data"].get("tokenizer")
    if (saved_tokenizer is None) != (tokenizer is None):  # paths may differ for the same files; bytes vs ids may not
        notes.append(f"warning: the checkpoint's run tokenized text with {saved_tokenizer or 'bytes'}, this run with "
                     f"{tokenizer or 'bytes'} (--tokenizer; the checkpoint keeps a copy of its tokenizer in {path})")
    if saved["seed"] != current["seed"]:
        notes.append(f"warning: --seed changed from {saved['seed']} to {current['seed']}")
    if saved["optim"]["steps"] != current["optim"]["steps"]:
        notes.append(f"warning: --steps changed from {saved['optim']['steps']} to {current['optim']['steps']}; "
                     f"the LR schedule continues from step {step} over the new length")
    return notes


# --- writing ----------------------------------------------------------------------------------------------

def check_writable_dir(directory: Path) -> None:
    """Create ``directory`` if needed and prove a file can be created in it (root ignores permissions,
    so ``os.access`` would not tell)."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"--checkpoint-dir {directory}: not a folder (a file of that name exists)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointError(f"--checkpoint-dir {directory}: cannot write there ({e.strerror or e})") from None


def write_manifest(folder: Path, *, step: int, config: dict, files: dict[str, dict], index: dict | None = None) -> None:
    """``index``: dcp_index() of the folder's .metadata (optional: readers fall back to the file)."""
    manifest = {"format": FORMAT, "step": step, "config": config, "files": files}
    if index is not None:
        manifest["dcp_index"] = index
    write_text(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True), durable=True)


def publish(tmp: Path, directory: Path, step: int) -> Path:
    """Rename a finished ``.tmp-step-N`` folder to ``step-N`` and point the marker at it.

    Called on one rank after every rank's shards and the manifest are on disk. A rename within one
    folder is atomic: readers see the whole checkpoint or none of it.
    """
    final = step_folder(directory, step)
    if final.exists():  # saved at this step before (e.g. a resume from an older checkpoint): replace it
        stale = directory / f".old-{final.name}"
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
        os.rename(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(tmp, final)
    write_text(directory / MARKER, final.name + "\n", durable=True)  # durable: syncs the folder's renames too
    return final


def prune(directory: Path, *, keep: int, protect: Path) -> threading.Thread:
    """Delete all but the newest ``keep`` published checkpoints, and abandoned temporary folders, in the
    background: each is first renamed to ``.deleting-...`` (atomic and instant: no reader sees a half-deleted
    checkpoint), then removed by the returned thread, so no rank waits for a large checkpoint's files to be
    unlinked. The thread does not hold up the process's exit (a preempted run leaves promptly); a deletion
    it cut short is finished by the next prune."""
    doomed = [step_folder(directory, step) for step in published_steps(directory)[:-keep]]
    for folder in [f for f in doomed if f != protect] + list(directory.glob(".tmp-step-*")):
        with contextlib.suppress(OSError):
            os.rename(folder, directory / f"{_DELETING}{folder.name.lstrip('.')}")
    leftovers = list(directory.glob(f"{_DELETING}*"))
    thread = threading.Thread(target=lambda: [shutil.rmtree(f, ignore_errors=True) for f in leftovers],
                              name="checkpoint-prune", daemon=True)
    thread.start()
    return thread
