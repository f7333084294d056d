"""SVG charts are standalone XML documents whose shapes follow the values they are given."""

import xml.etree.ElementTree as ET

from runtime.observe import svg

NS = {"svg": svg.SVG_NS}


def _parse(text: str) -> ET.Element:
    root = ET.fromstring(text)
    assert root.tag == f"{{{svg.SVG_NS}}}svg"
    assert all(root.get(k) for k in ("width", "height", "viewBox"))
    return root


def _texts(root: ET.Element) -> list[str]:
    return [t.text for t in root.iterfind(".//svg:text", NS)]


def test_nice_ticks_cover_the_range_in_round_steps():
    assert svg.nice_ticks(0, 1.83) == [0, 0.5, 1.0, 1.5, 2.0]
    assert svg.nice_ticks(1, 8) == [0, 2, 4, 6, 8]
    assert len(svg.nice_ticks(4, 4)) >= 2  # one value still gets an axis


def test_bar_chart_draws_longer_bars_for_larger_values_and_a_marker_per_bar():
    root = _parse(svg.bar_chart("Speed-up", ["naive", "1f1b", "zero-bubble"], {"measured": [1.0, 1.6, 1.8]},
                                markers={"bound": [1.0, 1.78, 2.0]}, reference=("baseline", 1.0),
                                value_label="speed-up (x)"))
    texts = _texts(root)
    assert {"Speed-up", "naive", "1f1b", "zero-bubble", "measured", "bound", "baseline", "speed-up (x)"} <= set(texts)
    assert root.find("svg:title", NS).text == "Speed-up"
    widths = [float(r.get("width")) for r in root.iterfind("svg:rect", NS) if r.get("fill") == svg.PALETTE[0]
              and r.get("height") != "10"]  # the bars, not the legend swatch
    assert len(widths) == 3 and widths[0] < widths[1] < widths[2]
    bound = [float(line.get("x1")) for line in root.iterfind("svg:line", NS)
             if line.get("stroke") == svg.MARKER_COLORS[0] and line.get("stroke-width") == "3"]
    assert len(bound) == 3 and bound[0] < bound[1] < bound[2]


def test_bar_chart_leaves_out_missing_values():
    root = _parse(svg.bar_chart("t", ["a", "b"], {"s": [2.0, None]}, value_label="v"))
    assert len([r for r in root.iterfind("svg:rect", NS) if r.get("fill") == svg.PALETTE[0]]) == 2  # bar + swatch


def test_line_chart_maps_larger_values_higher_and_dashes_the_ideal():
    root = _parse(svg.line_chart("Scaling", {"DP": [(1, 1.0), (2, 1.8), (4, 3.0)], "ideal": [(1, 1), (2, 2), (4, 4)]},
                                 x_label="ranks", y_label="speed-up", dashed=["ideal"], reference=("budget", 3.5)))
    assert {"Scaling", "DP", "ideal", "budget", "ranks", "speed-up"} <= set(_texts(root))
    lines = {p.get("stroke"): p for p in root.iterfind("svg:polyline", NS)}
    dp = [tuple(map(float, xy.split(","))) for xy in lines[svg.PALETTE[0]].get("points").split()]
    assert [x for x, _ in dp] == sorted(x for x, _ in dp) and dp[0][0] < dp[-1][0]
    assert dp[0][1] > dp[1][1] > dp[2][1]  # SVG's y grows downwards
    assert lines[svg.DASHED_COLORS[0]].get("stroke-dasharray")


def test_stacked_bar_chart_splits_each_bar_by_category():
    root = _parse(svg.stacked_bar_chart("Time", ["rank 0", "rank 1"], {"forward": [30, 60], "idle": [70, 40]},
                                        value_label="%"))
    assert {"Time", "rank 0", "rank 1", "forward", "idle", "%"} <= set(_texts(root))
    segments = [r for r in root.iterfind("svg:rect", NS) if r.find("svg:title", NS) is not None]
    widths = {s.find("svg:title", NS).text: float(s.get("width")) for s in segments}
    assert widths["forward: 30"] < widths["forward: 60"] and widths["idle: 70"] > widths["idle: 40"]


def test_text_is_escaped():
    text = svg.bar_chart("a < b & \"c\"", ["<script>"], {"x & y": [1.0]}, value_label="1 > 0")
    root = _parse(text)
    assert "<script>" not in text
    assert {"a < b & \"c\"", "<script>", "x & y", "1 > 0"} <= set(_texts(root))
