"""A per-minute line chart as inline SVG, drawn on the server (no script, no image file).

Colours and strokes are SVG presentation attributes, not ``style`` attributes, so the
console's Content-Security-Policy (no inline styles) holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from mqdedup.console.html import Html, h, tag

WIDTH = 720
HEIGHT = 160
_LEFT = 44
_BOTTOM = 22
_TOP = 10
_RIGHT = 24
COLOURS = ("#2563eb", "#d97706", "#16a34a", "#dc2626")


def minutes(start: datetime, end: datetime) -> list[datetime]:
    """Every minute from ``start`` (floored) to ``end`` (inclusive)."""
    first = start.replace(second=0, microsecond=0)
    count = int((end - first).total_seconds() // 60) + 1
    return [first + timedelta(minutes=i) for i in range(max(count, 1))]


def line_chart(
    axis: Sequence[datetime], series: Mapping[str, Mapping[datetime, int]], *, title: str
) -> Html:
    """Lines of per-minute counts over ``axis`` (missing minutes count 0), with a legend."""
    peak = max([1, *(v for counts in series.values() for v in counts.values())])
    plot_w = WIDTH - _LEFT - _RIGHT
    plot_h = HEIGHT - _TOP - _BOTTOM
    step = plot_w / max(len(axis) - 1, 1)

    def y(value: int) -> float:
        return _TOP + plot_h - plot_h * value / peak

    parts: list[Html] = [
        tag("title", title),
        tag("line", x1=_LEFT, y1=_TOP + plot_h, x2=WIDTH - _RIGHT, y2=_TOP + plot_h, stroke="#999"),
        tag("line", x1=_LEFT, y1=_TOP, x2=_LEFT, y2=_TOP + plot_h, stroke="#999"),
        tag("text", str(peak), x=_LEFT - 4, y=_TOP + 8, text_anchor="end", font_size=10),
        tag("text", "0", x=_LEFT - 4, y=_TOP + plot_h, text_anchor="end", font_size=10),
    ]
    if axis:
        for index in (0, len(axis) // 2, len(axis) - 1):
            parts.append(
                tag(
                    "text",
                    axis[index].strftime("%H:%M"),
                    x=round(_LEFT + index * step, 1),
                    y=HEIGHT - 6,
                    text_anchor="middle",
                    font_size=10,
                )
            )
    legend: list[Html] = []
    for number, (name, counts) in enumerate(series.items()):
        colour = COLOURS[number % len(COLOURS)]
        points = " ".join(
            f"{_LEFT + i * step:.1f},{y(counts.get(minute, 0)):.1f}"
            for i, minute in enumerate(axis)
        )
        parts.append(tag("polyline", points=points, fill="none", stroke=colour, stroke_width=1.5))
        legend.append(
            tag("span", tag("b", "\u25a0", class_=f"c{number % len(COLOURS)}"), " ", name, " ")
        )
    svg = tag(
        "svg",
        *parts,
        xmlns="http://www.w3.org/2000/svg",
        viewBox=f"0 0 {WIDTH} {HEIGHT}",
        width=WIDTH,
        height=HEIGHT,
        role="img",
        aria_label=title,
    )
    return tag("figure", svg, tag("figcaption", h(title), " ", *legend), class_="chart")
