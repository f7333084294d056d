"""Conversations into windows: pure integer logic, the same on every rank.

A window holds T + 1 tokens (T inputs, the last of them also the first target; the targets are tokens 1 to T),
so conversations of at most T + 1 tokens fit one. A longer conversation is cut to its first T + 1 tokens
(``truncate``) or left out (``drop``): ``--long-conversations``.

**Packing** (``--no-packing`` off): best-fit decreasing, the bin-packing rule TRL's ``pack_dataset(strategy="bfd")``
uses (Johnson et al. 1974: at most 11/9 of the optimal number of windows plus a constant): conversations longest
first, each into the open window whose free room is the smallest that still holds it, else a new window.
The rooms are integers up to T + 1, so a sorted list of the distinct rooms and a stack of windows per room
find that window by bisection. Without packing every conversation has a window of its own (padded).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

LONG_CONVERSATIONS = ("truncate", "drop")


@dataclass(frozen=True)
class Fitted:
    kept: list[int]  # per conversation: the tokens it keeps (0: dropped)
    truncated: int
    dropped: int


def fit_to_window(lengths: list[int], *, capacity: int, policy: str) -> Fitted:
    """Each conversation's length after ``policy`` ("truncate" or "drop") for windows of ``capacity`` tokens."""
    if policy not in LONG_CONVERSATIONS:
        raise ValueError(f"--long-conversations must be one of {', '.join(LONG_CONVERSATIONS)}, got {policy!r}")
    long = sum(n > capacity for n in lengths)
    if policy == "truncate":
        return Fitted([min(n, capacity) for n in lengths], truncated=long, dropped=0)
    return Fitted([n if n <= capacity else 0 for n in lengths], truncated=0, dropped=long)


def best_fit_decreasing(lengths: list[int], *, capacity: int) -> list[list[int]]:
    """Items (by index into ``lengths``, each 1 to ``capacity`` long) packed into windows of ``capacity``; each
    window lists its items in the order they went in (longest first)."""
    windows: list[list[int]] = []
    rooms: list[int] = []  # sorted distinct free rooms of open windows
    by_room: dict[int, list[int]] = {}  # room -> the open windows with that much free, a stack
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        need = lengths[item]
        if not 0 < need <= capacity:
            raise ValueError(f"item {item} has {need} tokens; a window holds 1 to {capacity}")
        at = bisect.bisect_left(rooms, need)
        if at < len(rooms):
            room = rooms[at]
            window = by_room[room].pop()
            if not by_room[room]:
                del rooms[at], by_room[room]
        else:
            room, window = capacity, len(windows)
            windows.append([])
        windows[window].append(item)
        left = room - need
        if left:
            if left not in by_room:
                bisect.insort(rooms, left)
                by_room[left] = []
            by_room[left].append(window)
    return windows


def one_per_window(lengths: list[int]) -> list[list[int]]:
    """Without packing: item i alone in window i."""
    return [[i] for i in range(len(lengths))]
