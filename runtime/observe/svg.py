"""Charts as standalone SVG text: horizontal bars (grouped, with reference markers), lines, stacked bars.

Plain strings and no plotting package, so any command can draw without new dependencies: a browser or
a Markdown viewer shows the files next to a report, and a test can parse them as XML. Every function
returns a whole SVG document.
"""

from __future__ import annotations

import math
from html import escape
from typing import Mapping, Sequence

SVG_NS = "http://www.w3.org/2000/svg"
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f", "#bab0ac")
MARKER_COLORS = ("#222222", "#d62728", "#7f7f7f")
DASHED_COLOR = "#888888"
DASHED_COLORS = (DASHED_COLOR, "#222222", "#bbbbbb")  # ideal lines: greys, told apart by shade
FONT = 11
CHAR_WIDTH = 6.5  # roughly a character's width at FONT px: sizes margins without a font engine
TOP = 40  # below the title, where the legend starts


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round ticks covering [low, high] in steps of 1, 2 or 5 x 10^k (Heckbert, "Nice numbers for graph labels")."""
    raw = ((high - low) or abs(high) or 1.0) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first, last = math.floor(low / step), math.ceil(high / step)
    return [round(i * step, 12) for i in range(first, max(last, first + 1) + 1)]  # two ticks at least: an axis


def _scale(domain: tuple[float, float], span: tuple[float, float]):
    (d0, d1), (r0, r1) = domain, span
    return lambda v: r0 + (v - d0) * (r1 - r0) / ((d1 - d0) or 1.0)


def _text(x: float, y: float, s: str, *, anchor: str = "start", size: int = FONT, extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}"{extra}>{escape(str(s))}</text>'


def _label(v: float) -> str:
    return f"{v:g}"


def _document(width: int, height: int, title: str, body: list[str]) -> str:
    head = (f'<svg xmlns="{SVG_NS}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'font-family="sans-serif" font-size="{FONT}">')
    return "\n".join([head, f"<title>{escape(title)}</title>", '<rect width="100%" height="100%" fill="white"/>',
                      _text(width / 2, 20, title, anchor="middle", size=14, extra=' font-weight="bold"'),
                      *body, "</svg>"]) + "\n"


def _legend(items: list[tuple[str, str, str]], *, left: float, width: float) -> tuple[list[str], float]:
    """A legend row, wrapped to ``width``: (name, color, kind) with kind "box", "line" or "dash".
    Returns the elements and the height used."""
    out, x, y = [], left, TOP
    for name, color, kind in items:
        advance = 22 + len(name) * CHAR_WIDTH + 14
        if x + advance > left + width and x > left:
            x, y = left, y + 16
        if kind == "box":
            out.append(f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="14" height="10" fill="{color}"/>')
        else:
            dash = ' stroke-dasharray="5 3"' if kind == "dash" else ""
            out.append(f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 16:.1f}" y2="{y - 4:.1f}" stroke="{color}" '
                       f'stroke-width="2"{dash}/>')
        out.append(_text(x + 20, y, name))
        x += advance
    return out, y - TOP + 20


def _x_axis(scale, ticks: list[float], *, y: float, top: float, label: str) -> list[str]:
    """Bottom axis with vertical grid lines from ``top`` down to ``y``."""
    out = [f'<line x1="{scale(ticks[0]):.1f}" y1="{y:.1f}" x2="{scale(ticks[-1]):.1f}" y2="{y:.1f}" stroke="black"/>']
    for t in ticks:
        x = scale(t)
        out += [f'<line x1="{x:.1f}" y1="{top:.1f}" x2="{x:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>',
                f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x:.1f}" y2="{y + 4:.1f}" stroke="black"/>',
                _text(x, y + 16, _label(t), anchor="middle")]
    return out + [_text((scale(ticks[0]) + scale(ticks[-1])) / 2, y + 34, label, anchor="middle")]


def _y_axis(scale, ticks: list[float], *, x: float, right: float, label: str) -> list[str]:
    """Left axis with horizontal grid lines from ``x`` across to ``right``."""
    out = [f'<line x1="{x:.1f}" y1="{scale(ticks[0]):.1f}" x2="{x:.1f}" y2="{scale(ticks[-1]):.1f}" stroke="black"/>']
    for t in ticks:
        y = scale(t)
        out += [f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{right:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>',
                _text(x - 6, y + 4, _label(t), anchor="end")]
    middle = (scale(ticks[0]) + scale(ticks[-1])) / 2
    return out + [_text(16, middle, label, anchor="middle", extra=f' transform="rotate(-90 16 {middle:.1f})"')]


def _values(*groups) -> list[float]:
    return [v for group in groups for values in group for v in values if v is not None]


def bar_chart(title: str, labels: Sequence[str], series: Mapping[str, Sequence[float | None]], *, value_label: str,
              markers: Mapping[str, Sequence[float | None]] | None = None,
              reference: tuple[str, float] | None = None, width: int = 760) -> str:
    """Horizontal bars: a group per label, a bar per series. ``markers`` draw a tick across each group (e.g. a
    bound per bar), ``reference`` a vertical line across the chart (e.g. a baseline); None values are left out."""
    markers = markers or {}
    left = 16 + max((len(s) for s in labels), default=0) * CHAR_WIDTH
    items = [(n, PALETTE[i % len(PALETTE)], "box") for i, n in enumerate(series)]
    items += [(n, MARKER_COLORS[i % len(MARKER_COLORS)], "line") for i, n in enumerate(markers)]
    items += [(reference[0], DASHED_COLOR, "dash")] if reference else []
    legend, legend_h = _legend(items, left=left, width=width - left - 20)
    top, bar_h = TOP + legend_h, 14
    group_h = len(series) * bar_h + 10
    bottom = top + len(labels) * group_h
    high = max(_values(series.values(), markers.values()) + [reference[1] if reference else 0.0], default=1.0)
    ticks = nice_ticks(0.0, high or 1.0)
    x = _scale((ticks[0], ticks[-1]), (left, width - 20))
    body = legend + _x_axis(x, ticks, y=bottom, top=top, label=value_label)
    for i, name in enumerate(labels):
        y0 = top + i * group_h + 5
        body.append(_text(left - 6, y0 + group_h / 2, name, anchor="end"))
        # Value labels start past the group's markers, which would hide them.
        label_x = max([x(v[i]) for v in [*series.values(), *markers.values()] if v[i] is not None], default=left) + 4
        for j, values in enumerate(series.values()):
            if values[i] is not None:
                y = y0 + j * bar_h
                body += [f'<rect x="{left:.1f}" y="{y:.1f}" width="{x(values[i]) - left:.1f}" height="{bar_h - 2}" '
                         f'fill="{PALETTE[j % len(PALETTE)]}"/>', _text(label_x, y + bar_h - 4, f"{values[i]:.3g}")]
        for k, values in enumerate(markers.values()):
            if values[i] is not None:
                body.append(f'<line x1="{x(values[i]):.1f}" y1="{y0 - 3:.1f}" x2="{x(values[i]):.1f}" '
                            f'y2="{y0 + group_h - 7:.1f}" stroke="{MARKER_COLORS[k % len(MARKER_COLORS)]}" stroke-width="3"/>')
    if reference:
        body.append(f'<line x1="{x(reference[1]):.1f}" y1="{top:.1f}" x2="{x(reference[1]):.1f}" y2="{bottom:.1f}" '
                    f'stroke="{DASHED_COLOR}" stroke-width="1.5" stroke-dasharray="5 3"/>')
    return _document(width, int(bottom + 50), title, body)


def line_chart(title: str, series: Mapping[str, Sequence[tuple[float, float]]], *, x_label: str, y_label: str,
               dashed: Sequence[str] = (), reference: tuple[str, float] | None = None,
               width: int = 640, height: int = 400) -> str:
    """Lines through (x, y) points, one per series, with a dot per point; series named in ``dashed`` (e.g. the
    ideal) are drawn dashed and grey, ``reference`` is a horizontal dashed line (e.g. a budget)."""
    solid, grey = [n for n in series if n not in dashed], [n for n in series if n in dashed]
    items = [(n, DASHED_COLORS[grey.index(n) % len(DASHED_COLORS)], "dash") if n in dashed
             else (n, PALETTE[solid.index(n) % len(PALETTE)], "line") for n in series]
    items += [(reference[0], MARKER_COLORS[1], "dash")] if reference else []
    legend, legend_h = _legend(items, left=60, width=width - 80)
    top, bottom, left, right = TOP + legend_h + 6, height - 50, 60, width - 20
    points = [p for pts in series.values() for p in pts]
    x_ticks = nice_ticks(min((p[0] for p in points), default=0.0), max((p[0] for p in points), default=1.0))
    y_high = max([p[1] for p in points] + [reference[1] if reference else 0.0], default=1.0)
    y_ticks = nice_ticks(0.0, y_high or 1.0)
    x, y = _scale((x_ticks[0], x_ticks[-1]), (left, right)), _scale((y_ticks[0], y_ticks[-1]), (bottom, top))
    body = legend + _y_axis(y, y_ticks, x=left, right=right, label=y_label)
    body += _x_axis(x, x_ticks, y=bottom, top=top, label=x_label)
    for (name, pts), (_, color, kind) in zip(series.items(), items):
        coords = " ".join(f"{x(px):.1f},{y(py):.1f}" for px, py in sorted(pts))
        dash = ' stroke-dasharray="6 4"' if kind == "dash" else ""
        body.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        body += [f'<circle cx="{x(px):.1f}" cy="{y(py):.1f}" r="3.5" fill="{color}"/>' for px, py in pts if not dash]
    if reference:
        body.append(f'<line x1="{left}" y1="{y(reference[1]):.1f}" x2="{right}" y2="{y(reference[1]):.1f}" '
                    f'stroke="{MARKER_COLORS[1]}" stroke-width="1.5" stroke-dasharray="5 3"/>')
    return _document(width, height, title, body)


def stacked_bar_chart(title: str, labels: Sequence[str], segments: Mapping[str, Sequence[float]], *,
                      value_label: str, width: int = 760) -> str:
    """One horizontal bar per label, split into a segment per category (the legend names them)."""
    left = 16 + max((len(s) for s in labels), default=0) * CHAR_WIDTH
    colors = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(segments)}
    legend, legend_h = _legend([(n, c, "box") for n, c in colors.items()], left=left, width=width - left - 20)
    top, bar_h = TOP + legend_h, 18
    bottom = top + len(labels) * (bar_h + 6) + 4
    totals = [sum(values[i] or 0.0 for values in segments.values()) for i in range(len(labels))]
    ticks = nice_ticks(0.0, max(totals, default=1.0) or 1.0)
    x = _scale((ticks[0], ticks[-1]), (left, width - 20))
    body = legend + _x_axis(x, ticks, y=bottom, top=top, label=value_label)
    for i, name in enumerate(labels):
        y, start = top + 4 + i * (bar_h + 6), 0.0
        body.append(_text(left - 6, y + bar_h - 5, name, anchor="end"))
        for category, values in segments.items():
            value = values[i] or 0.0
            body.append(f'<rect x="{x(start):.1f}" y="{y:.1f}" width="{x(start + value) - x(start):.1f}" '
                        f'height="{bar_h}" fill="{colors[category]}"><title>{escape(category)}: {value:.3g}</title></rect>')
            start += value
    return _document(width, int(bottom + 50), title, body)
