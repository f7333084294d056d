"""The data cache: byte tokens of text corpora and the results of token-file scans, computed once per machine.

Every rank checks its inputs before any process group exists, so ranks cannot agree on who prepares
the data. They take an exclusive ``flock`` on the entry's lock file instead: the first computes and
publishes the entry (written privately, renamed into place), the others wait for the lock and find it.
A cache folder that cannot be written leaves every rank to compute its own result in memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path
from typing import Callable, Iterator

from runtime.atomic import atomic_file


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybrid_engine" / "tokens"


def file_identity(path: Path) -> str:
    """A file's identity for cache keys: where it is, its size and when it was last written."""
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def cache_key(*parts: object) -> str:
    return hashlib.sha256("\n".join(str(p) for p in parts).encode()).hexdigest()[:24]


def usable(cache_dir: Path) -> bool:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(cache_dir, os.W_OK)


@contextlib.contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock`` (created if absent) for the block; released if the process dies."""
    with open(lock, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def write_atomically(path: Path, write: Callable[[object], None]) -> None:
    """Call ``write(binary file)`` on a private file, then publish it under ``path`` with one rename."""
    with atomic_file(path) as out:
        write(out)
