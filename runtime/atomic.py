"""Files written atomically: a reader sees the old file or the whole new one, never a part. Every file the engine
writes for others to read (checkpoint manifests and markers, safetensors and exports, the data cache, token files,
study results) goes through here.

A file is written beside its final name under a hidden temporary name, flushed to disk, then renamed over the final
name (POSIX rename is atomic within a directory); on any error, an interrupt included, the temporary file is removed
and the final name left as it was. ``durable`` also syncs the directory, so the rename itself survives a crash
(what a checkpoint's completion marker needs).
"""

from __future__ import annotations

import json
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator


class AtomicWriteError(OSError):
    """``path`` could not be written; the message names it."""


def temporary_beside(path: Path) -> tuple[int, Path]:
    """A new file beside ``path`` (an open descriptor and its name) to rename over it later; unlike mkstemp's 0600
    it gets the umask's mode, as the file it replaces would."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
        except OSError as e:
            raise AtomicWriteError(f"{path}: cannot be written ({e.strerror or e})") from None
    raise AtomicWriteError(f"{path}: cannot be written (no free temporary name beside it)")


def publish(tmp: Path, path: Path, *, durable: bool = False) -> None:
    """Rename the finished ``tmp`` over ``path``; ``durable``: sync the directory so the rename survives a crash."""
    os.replace(tmp, path)
    if durable:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike, *, durable: bool = False) -> Iterator[BinaryIO]:
    """A binary file opened beside ``path`` that becomes ``path`` when the block ends (fsync, then a rename over
    it). An OSError while writing is an ``AtomicWriteError`` naming ``path``."""
    path = Path(path)
    fd, tmp = temporary_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path, durable=durable)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, AtomicWriteError):
            raise
        raise AtomicWriteError(f"{path}: cannot be written ({e.strerror or e})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = False) -> None:
    with atomic_file(path, durable=durable) as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str, *, durable: bool = False) -> None:
    write_bytes(path, text.encode("utf-8"), durable=durable)


def write_json(path: str | os.PathLike, value: object, **dumps) -> None:
    """``value`` as JSON (``dumps``: json.dumps's options) with a final newline."""
    write_text(path, json.dumps(value, **dumps) + "\n")
