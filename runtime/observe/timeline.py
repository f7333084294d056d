"""Turn per-rank step profiles into a time-split table, a Chrome trace and a Gantt chart image.

The image is drawn straight into a uint8 tensor (no matplotlib): one row per rank, one box per
forward (blue), backward (green), input-gradient (teal) and weight-gradient (orange) action, with
the micro-batch number written in a 3x5 pixel font; red marks communication, purple the optimizer,
and the light background is time the rank spent idle or in bookkeeping.
"""

from __future__ import annotations

import torch

from runtime.observe.profiling import CATEGORIES, StepProfile

COLORS = {
    "F": (66, 133, 244), "B": (52, 168, 83), "I": (0, 150, 136), "W": (251, 140, 0),
    "comm": (219, 68, 55), "optimizer": (142, 68, 173), "background": (240, 240, 240),
    "text": (255, 255, 255), "label": (40, 40, 40),
}
ACTION_KINDS = ("F", "B", "I", "W")

# 3x5 glyphs, five rows of three pixels read left to right, top to bottom; "#" = ink.
_FONT = {
    "0": "####.##.##.####", "1": ".#.##..#..#.###", "2": "###..#####..###", "3": "###..####..####",
    "4": "#.##.####..#..#", "5": "####..###..####", "6": "####..####.####", "7": "###..#..#..#..#",
    "8": "####.#####.####", "9": "####.####..####", "r": "...##.#..#..#..",
}


def time_split(profile: StepProfile) -> dict[str, float]:
    """Seconds per category plus fractions of the step; the categories add up to the step time."""
    split = {k: profile.exclusive.get(k, 0.0) for k in CATEGORIES}
    return {"step_time": profile.step_time, **split,
            **{f"{k}_fraction": v / profile.step_time for k, v in split.items()}}


def chrome_trace(profiles: list[StepProfile], *, rank_labels: dict[int, str]) -> dict:
    """Chrome trace events (Perfetto / chrome://tracing): one track per rank, nested slices."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "pipeline step"}}]
    for profile in profiles:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": profile.rank,
                       "args": {"name": rank_labels.get(profile.rank, f"rank {profile.rank}")}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": profile.rank,
                       "args": {"sort_index": profile.rank}})
        for span in profile.spans:
            events.append({"name": span.name, "cat": span.category, "ph": "X", "pid": 0, "tid": profile.rank,
                           "ts": span.start * 1e6, "dur": (span.end - span.start) * 1e6, "args": span.args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def render_gantt(profiles: list[StepProfile], *, width: int = 1200, row_height: int = 26) -> torch.Tensor:
    """(H, W, 3) uint8 image of every rank's step, time on the x axis."""
    margin, gap = 22, 4
    height = gap + len(profiles) * (row_height + gap)
    image = torch.full((height, margin + width, 3), 255, dtype=torch.uint8)
    end = max(p.step_time for p in profiles) or 1.0
    scale = width / end
    for row, profile in enumerate(sorted(profiles, key=lambda p: p.rank)):
        top = gap + row * (row_height + gap)
        _fill(image, top, top + row_height, margin, margin + width, COLORS["background"])
        _text(image, f"r{profile.rank}", top + (row_height - 5) // 2, 2, COLORS["label"])
        for span in sorted(profile.spans, key=lambda s: s.depth):
            x0 = margin + int(span.start * scale)
            x1 = max(x0 + 1, margin + int(span.end * scale))
            kind = span.args.get("kind")
            if kind in ACTION_KINDS:
                _fill(image, top, top + row_height, x0, x1, COLORS[kind])
                _fill(image, top, top + row_height, x0, x0 + 1, COLORS["background"])  # box boundary
                label = str(span.args.get("microbatch", ""))
                if x1 - x0 >= 4 * len(label) + 3:
                    _text(image, label, top + (row_height - 5) // 2, x0 + 2, COLORS["text"])
            elif span.category in ("tp_comm", "dp_comm", "pp_send_recv") and span.depth == 0:
                _fill(image, top + row_height - 5, top + row_height, x0, x1, COLORS["comm"])
            elif span.category == "optimizer":
                _fill(image, top, top + row_height, x0, x1, COLORS["optimizer"])
    return image


def _fill(image: torch.Tensor, y0: int, y1: int, x0: int, x1: int, color: tuple[int, int, int]) -> None:
    image[y0:y1, x0:x1] = torch.tensor(color, dtype=torch.uint8)


def _text(image: torch.Tensor, text: str, y: int, x: int, color: tuple[int, int, int]) -> None:
    for i, ch in enumerate(text):
        glyph = _FONT.get(ch)
        if glyph is None:
            continue
        for gy in range(5):
            for gx in range(3):
                if glyph[gy * 3 + gx] == "#":
                    yy, xx = y + gy, x + i * 4 + gx
                    if 0 <= yy < image.shape[0] and 0 <= xx < image.shape[1]:
                        image[yy, xx] = torch.tensor(color, dtype=torch.uint8)
