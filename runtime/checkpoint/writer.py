"""DCP's file-system writer, made to hash every file as its bytes go out, and the staging of background saves.

A checkpoint's manifest records each file's sha256 (runtime/checkpoint/files.py). Reading every file
back after the save to hash it costs one more pass over the whole checkpoint per save; here each rank
hashes the bytes of the files it writes while it writes them (DCP writes a file front to back through
``FileSystem.create_stream``), so the data is touched once, by the rank that has it. A file whose
writes were not strictly sequential (a seek) gets no digest and is hashed from disk instead
(``runtime/checkpoint/saving.py``), so a change in how DCP writes can cost time, never a wrong digest.

Background saves first copy the state to host memory (DCP's staging; the writer's own staging allocates
fresh pageable buffers every save, faulted in page by page). On an accelerator the copy goes to
page-locked buffers allocated once and reused by every save (``BlockingAsyncStager``'s cache, on torch
2.11 and 2.13): from pageable memory the driver stages a device-to-host copy itself. On the CPU that cache
cannot be used (it pins, which needs an accelerator); ``DefaultStager`` without pinning keeps its buffers
from one save to the next on torch 2.13 (2.11 drops them after each save: fresh buffers, as before).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import threading
from pathlib import Path
from typing import Iterator

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager, DefaultStager, StagingOptions


class _HashingStream:
    """A file opened for writing whose bytes are hashed on their way out."""

    def __init__(self, raw):
        self._raw, self._sha, self._bytes, self._sequential = raw, hashlib.sha256(), 0, True
        self._end: int | None = None  # the position when it was closed

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        self._sha.update(view)
        self._bytes += len(view)
        return written

    def seek(self, *args):
        self._sequential = False  # the digest would no longer describe the file
        return self._raw.seek(*args)

    def truncate(self, *args):
        self._sequential = False
        return self._raw.truncate(*args)

    def close(self) -> None:  # DCP closes the file itself, inside create_stream
        self._end = self._end if self._raw.closed else self._raw.tell()
        self._raw.close()

    def __getattr__(self, name):  # tell, flush, fileno, ...: the file's own
        return getattr(self._raw, name)

    def digest(self) -> dict | None:
        """{"bytes", "sha256"} of the file as written, or None if it was not written front to back."""
        end = self._end if self._raw.closed else self._raw.tell()
        if not self._sequential or end != self._bytes:
            return None
        return {"bytes": self._bytes, "sha256": self._sha.hexdigest()}


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording the digest of every file written in full (by final name)."""

    def __init__(self):
        super().__init__()
        self.digests: dict[str, dict] = {}
        self._lock = threading.Lock()  # DCP may write a rank's files from several threads

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator:
        with super().create_stream(path, mode) as stream:
            if mode != "wb":
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
            digest = hashing.digest()
        if digest is not None:
            with self._lock:
                self.digests[Path(path).name] = digest

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata under a temporary name first
        with self._lock:
            digest = self.digests.pop(Path(path).name, None)
            if digest is not None:
                self.digests[Path(new_path).name] = digest


class CheckpointWriter(FileSystemWriter):
    """FileSystemWriter (synced files) that hashes what it writes (``digests``), keeps the metadata DCP
    finishes the checkpoint with (``metadata``: on the rank that writes ``.metadata``) and, for a
    ``background`` save, lowers the priority of the thread it writes on (nice 19, this thread only: on
    Linux a thread is a task of its own), so the write takes cores the training ranks leave idle (waiting
    on a peer, the pipeline bubble) rather than slowing their steps."""

    def __init__(self, path: Path, *, background: bool):
        super().__init__(path, sync_files=True, overwrite=True)
        self.fs = HashingFileSystem()
        self.background = background
        self.metadata = None

    @property
    def digests(self) -> dict[str, dict]:
        return dict(self.fs.digests)

    def set_up_storage_writer(self, *args, **kwargs):  # DCP's first call on the writing thread
        if self.background and hasattr(os, "setpriority"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return super().set_up_storage_writer(*args, **kwargs)

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        # What FileSystemWriter.finish writes to .metadata: the storage index of every item written. Rebuilt
        # here because torch 2.11's finish fills a copy (dataclasses.replace) and 2.13's the object it is given.
        storage = {wr.index: wr.storage_data for written in results for wr in written}
        self.metadata = dataclasses.replace(metadata, storage_data=storage)


def build_stager(device: torch.device) -> AsyncStager:
    """The stager background saves copy the state with, kept for the run: its buffers are reused by every save
    (one save is in flight at a time, so the previous write has read them). Synchronous: the copy is the
    pause training sees, and the weights change again right after it."""
    if device.type == "cpu":
        return CpuSnapshotStager()
    return BlockingAsyncStager(cache_staged_state_dict=True)


class CpuSnapshotStager(AsyncStager):
    """Synchronous, unpinned copies through torch's ``DefaultStager``, one kept for the run where torch lets it
    be reused (2.13 keeps its buffers between saves). torch 2.11's ``DefaultStager`` closes its copier after
    every ``stage`` (its ``_stage`` calls ``StateDictStager.close()``, which empties the copier's dispatch
    table), so a second save through it raises ``KeyError: <class 'type'>``: there, each save gets a new one."""

    _synchronize_after_execute = False

    def __init__(self):
        self._stager = self._new()
        self._reusable: bool | None = None  # learnt after the first save

    @staticmethod
    def _new() -> DefaultStager:
        return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                            use_async_staging=False, use_non_blocking_copy=False))

    def stage(self, state_dict):
        staged = self._stager.stage(state_dict)
        if self._reusable is None:  # stage a trivial dict again: 2.11's closed copier fails at once
            try:
                self._stager.stage({"probe": type})
                self._reusable = True
            except KeyError:
                self._reusable = False
        if not self._reusable:  # the next save gets a copier of its own
            self._stager.close()
            self._stager = self._new()
        return staged

    def synchronize_staging(self) -> None:  # staging is synchronous
        pass

    def close(self) -> None:
        self._stager.close()
