"""Writing a checkpoint: in the foreground, or in the background while training goes on.

A save has two halves. ``begin_save``: rank 0 prepares DIR/.tmp-step-N, every rank hands DCP its state
(runtime/checkpoint/state.py), hashing the files it writes as it writes them (runtime/checkpoint/writer.py).
``finish_save``: every rank reports success or its error with its files' digests, rank 0 writes the
manifest (with an index of DCP's metadata, for the checks before a resumed run's process group exists) and
publishes the folder by a rename (runtime/checkpoint/files.py ``publish``); then, with no rank waiting for it,
it deletes the checkpoints past ``--keep-checkpoints`` in the background. A failure anywhere removes the
temporary folder and raises the same CheckpointError on every rank; the previous checkpoint is untouched.

``--async-checkpoint`` (a ``group`` given): DCP's ``async_save`` copies the state to host memory (the pause
training sees; into buffers reused by every save, page-locked on an accelerator: runtime/checkpoint/writer.py),
then writes it on a background thread, over a process group of its own so its collectives never interleave
with training's. Ranks learn that every rank's write is done through the step's all-reduce
(``Checkpointer.writing``), and finish at that step boundary; a save that is due while the previous one is
still writing, the last step's and a preemption's wait for it first.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager

from runtime.checkpoint.files import (
    CheckpointError,
    dcp_index,
    describe_file,
    prune,
    publish,
    step_folder,
    tmp_folder,
    write_manifest,
)
from runtime.checkpoint.state import TrainState, agree, failure_summary, rng_state, tensor_state, train_state_json
from runtime.checkpoint.writer import CheckpointWriter, build_stager
from runtime.distributed.collectives import all_gather_objects
from runtime.tokenizer import copy_tokenizer_files


@dataclass
class PendingSave:
    """A save whose shards are being (or have been) written, not yet published."""

    step: int
    directory: Path
    tmp: Path
    keep: int
    config: dict
    digests: Future  # {"files": {name: {"bytes", "sha256"}} this rank wrote, "index": dcp_index or None}
    began: float = field(default_factory=time.perf_counter)

    def written(self) -> bool:
        return self.digests.done()


def begin_save(state: TrainState, *, directory: Path, step: int, keep: int, group: dist.ProcessGroup | None = None,
               stager: AsyncStager | None = None) -> PendingSave:
    """Start saving the state after ``step`` steps. Without ``group`` the shards are written when this
    returns; with one, DCP has staged a host copy (with ``stager``, else the writer's own staging) and
    writes it in the background."""
    rank = dist.get_rank()
    directory, tmp = Path(directory), tmp_folder(directory, step)
    agree(lambda: _fresh_folder(tmp) if rank == 0 else None, what=f"prepare {tmp}")
    state_dict = {**tensor_state(state), "train_state": train_state_json(state, step), "rng": {f"rank{rank}": rng_state()}}
    writer = CheckpointWriter(tmp, background=group is not None)
    digests: Future = Future()

    def hash_share(written: Future) -> None:
        # The digests of what this rank wrote, computed as it wrote; the rank that wrote .metadata (after
        # every rank's shards) also indexes it for the manifest.
        try:
            written.result()
            index = dcp_index(writer.metadata) if writer.metadata is not None else None
            digests.set_result({"files": writer.digests, "index": index})
        except BaseException as e:  # handed to finish_save, which agrees on it with the other ranks
            digests.set_exception(e)

    if group is None:
        written: Future = Future()
        try:
            dcp.save(state_dict, storage_writer=writer)
            written.set_result(None)
        except (CheckpointException, OSError) as e:  # DCP agrees on failure: every rank gets here
            written.set_exception(e)
        hash_share(written)
    else:
        dcp.async_save(state_dict, storage_writer=writer, process_group=group,
                       async_stager=stager).add_done_callback(hash_share)
    return PendingSave(step, directory, tmp, keep, state.config, digests)


def finish_save(pending: PendingSave) -> Path:
    """Wait for this rank's write, agree with every rank that all writes succeeded, publish; returns the
    published folder. Every rank calls it at the same point."""
    rank = dist.get_rank()
    try:
        share, failure = pending.digests.result(), None
    except (CheckpointException, OSError) as e:
        share, failure = {"files": {}, "index": None}, failure_summary(e)
    reports = all_gather_objects((failure, share))
    failures = [f for f, _ in reports if f]
    if failures:
        _abandon(pending, failures[0])
    digests = {name: d for _, part in reports for name, d in part["files"].items()}
    index = next((part["index"] for _, part in reports if part["index"] is not None), None)

    def manifest_and_publish() -> None:
        # The run's tokenizer travels with its weights (a checkpoint folder is then a tokenizer folder too);
        # a file no rank hashed while writing it (see runtime/checkpoint/writer.py) is read back here.
        tokenizer = pending.config.get("data", {}).get("tokenizer")
        if tokenizer:
            copy_tokenizer_files(tokenizer, pending.tmp)
        files = {p.name: digests.get(p.name) or describe_file(p) for p in sorted(pending.tmp.iterdir())}
        write_manifest(pending.tmp, step=pending.step, config=pending.config, files=files, index=index)
        publish(pending.tmp, pending.directory, pending.step)

    try:
        agree(manifest_and_publish if rank == 0 else (lambda: None), what=f"publish {pending.tmp}")
    except CheckpointError as e:
        _abandon(pending, str(e))
    final = step_folder(pending.directory, pending.step)
    if rank == 0:  # after the agreement: no rank waits for old checkpoints' files to be unlinked
        prune(pending.directory, keep=pending.keep, protect=final)
    return final


def _abandon(pending: PendingSave, reason: str) -> NoReturn:
    """Every rank: remove the temporary folder (rank 0) and raise the same error naming what is left."""
    if dist.get_rank() == 0:
        _remove(pending.tmp)
    raise CheckpointError(f"could not save the checkpoint of step {pending.step} in {pending.directory}: {reason}; "
                          f"{_previous(pending.directory)}")


def _fresh_folder(path: Path) -> None:
    _remove(path)  # a crashed save of the same step may have left one behind
    path.mkdir(parents=True)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _previous(directory: Path) -> str:
    marker = directory / "latest"
    if marker.is_file():
        return f"the previous checkpoint {directory / marker.read_text().strip()} is intact"
    return "no earlier checkpoint exists"


@dataclass
class Checkpointer:
    """Saves on a cadence, at the end of the run and on preemption; prints where on the logging rank.

    ``pauses`` records, per saved step, the seconds training waited for that save (staging or the whole
    write, waiting for a previous write, hashing and publishing), the figure ``--async-checkpoint`` cuts.
    """

    directory: Path
    every: int | None
    keep: int
    state: TrainState
    verbose: bool
    group: dist.ProcessGroup | None = None  # set: write in the background over this group
    saved: list[str] = field(default_factory=list)
    pauses: dict[int, float] = field(default_factory=dict)
    pending: PendingSave | None = None
    stager: AsyncStager | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.group is not None and self.state.params:
            self.stager = build_stager(self.state.params[0][1].device)

    def due(self, step: int, *, last: bool) -> bool:
        return last or (self.every is not None and step % self.every == 0)

    @property
    def writing(self) -> bool:
        """This rank is still writing a background save (the step's all-reduce tells every rank)."""
        return self.pending is not None and not self.pending.written()

    def save(self, step: int, *, wait: bool = False) -> None:
        """Save the state after ``step``; ``wait``: publish it before returning (the run's last save)."""
        self.finish()  # one save at a time: a write still in flight is waited for (counted as its pause)
        start = time.perf_counter()
        self.pending = begin_save(self.state, directory=self.directory, step=step, keep=self.keep, group=self.group,
                                  stager=self.stager)
        self.pauses[step] = time.perf_counter() - start
        if self.group is None or wait:
            self.finish(waited=True)
        elif self.verbose:
            print(f"step {step}: checkpoint staged in {self.pauses[step]:.2f}s, writing in the background", flush=True)

    def finish(self, *, waited: bool = False) -> None:
        """Publish the save in flight, if any (waiting for its write); every rank calls it together."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        start = time.perf_counter()
        path = finish_save(pending)
        self.pauses[pending.step] = self.pauses.get(pending.step, 0.0) + time.perf_counter() - start
        self.saved.append(str(path))
        if self.verbose:
            how = (f"{self.pauses[pending.step]:.1f}s" if waited else
                   f"written in the background over {time.perf_counter() - pending.began:.1f}s, training paused "
                   f"{self.pauses[pending.step]:.2f}s")
            print(f"step {pending.step}: checkpoint saved to {path} ({how})", flush=True)
