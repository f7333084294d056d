"""A one-line progress report for long work over a known number of bytes: done / total, MB/s and ETA.

On a terminal the line is rewritten in place at most twice a second; in a log (not a TTY) a new line is
printed every ``log_every_s`` seconds. ``finish`` prints the summary line.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, what: str, total_bytes: int, *, stream: TextIO | None = None, log_every_s: float = 10.0,
                 clock=time.perf_counter):
        stream = stream or sys.stderr
        self.what, self.total, self.stream, self.clock = what, total_bytes, stream, clock
        self.done, self.items = 0, 0
        self.start = self.last = clock()
        self.interval = 0.5 if getattr(stream, "isatty", lambda: False)() else log_every_s
        self.tty = self.interval == 0.5

    def advance(self, n_bytes: int, items: int = 0) -> None:
        self.done += n_bytes
        self.items += items
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self.stream.write(("\r" if self.tty else "") + self.line(now) + ("" if self.tty else "\n"))
            self.stream.flush()

    def line(self, now: float | None = None) -> str:
        elapsed = max((now if now is not None else self.clock()) - self.start, 1e-9)
        rate = self.done / elapsed
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        eta = f", ETA {_duration((self.total - self.done) / rate)}" if rate > 0 and self.total > self.done else ""
        return (f"{self.what}: {self.done / 1e6:,.1f} / {self.total / 1e6:,.1f} MB{share}, {rate / 1e6:.2f} MB/s, "
                f"{self.items:,} tokens{eta}")

    def finish(self) -> float:
        """Print the final line; returns the seconds taken."""
        now = self.clock()
        self.stream.write(("\r" if self.tty else "") + self.line(now) + f", {now - self.start:.1f} s\n")
        self.stream.flush()
        return now - self.start


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
