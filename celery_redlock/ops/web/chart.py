"""A line chart in SVG, drawn on the server: no script, no library, readable without colour.

Each series is a polyline with a distinct colour *and* dash pattern, named in
a legend that also gives its total; the axes carry their units.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape

__all__ = ["line_chart", "nice_ceiling"]

WIDTH, HEIGHT = 760, 280
LEFT, RIGHT, TOP, BOTTOM = 56, 150, 16, 36

#: Colour and dash pattern of each series, in order (colour-blind safe palette).
STYLES = (
    ("#0072b2", ""),
    ("#e69f00", "6 3"),
    ("#009e73", "2 2"),
    ("#cc79a7", "8 3 2 3"),
    ("#d55e00", "4 4"),
    ("#56b4e9", "1 3"),
)


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is >= ``value`` (1 for 0)."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * power:
            return float(step * power)
    return float(10 * power)  # pragma: no cover - the loop ends at 10


def _label(value: float) -> str:
    return f"{value:g}" if value < 10 else f"{value:.0f}"


def _axes(top: float, points: int, x_label: str, y_label: str) -> list[str]:
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    parts = []
    for i in range(5):
        y = TOP + plot_h - plot_h * i / 4
        parts.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" '
            f'stroke="#ddd" stroke-width="1"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">'
            f"{_label(top * i / 4)}</text>"
        )
    ticks = 6
    for i in range(ticks + 1):
        x = LEFT + plot_w * i / ticks
        ago = round((points - 1) * (1 - i / ticks))
        parts.append(
            f'<text x="{x:.1f}" y="{TOP + plot_h + 16}" text-anchor="middle" font-size="11">'
            f"{'now' if ago == 0 else f'-{ago}'}</text>"
        )
    parts.append(
        f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 4}" text-anchor="middle" '
        f'font-size="11">{escape(x_label)}</text>'
        f'<text x="12" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" font-size="11" '
        f'transform="rotate(-90 12 {TOP + plot_h / 2:.1f})">{escape(y_label)}</text>'
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" '
        f'stroke="#888"/>'
    )
    return parts


def line_chart(
    series: Mapping[str, Sequence[float]], *, title: str, x_label: str, y_label: str
) -> str:
    """Return an ``<svg>`` element charting ``series`` (name -> values, oldest first)."""
    points = max((len(values) for values in series.values()), default=0)
    top = nice_ceiling(max((max(values) for values in series.values() if values), default=0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(title)}" '
        f'class="chart"><title>{escape(title)}</title>',
        *_axes(top, points, x_label, y_label),
    ]
    for index, (name, values) in enumerate(series.items()):
        colour, dash = STYLES[index % len(STYLES)]
        coords = " ".join(
            f"{LEFT + plot_w * i / max(1, points - 1):.1f},{TOP + plot_h - plot_h * v / top:.1f}"
            for i, v in enumerate(values)
        )
        dashing = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(
            f'<polyline class="series" data-name="{escape(name)}" points="{coords}" '
            f'fill="none" stroke="{colour}" stroke-width="2"{dashing}/>'
        )
        y = TOP + 14 + index * 18
        x = WIDTH - RIGHT + 12
        parts.append(
            f'<line x1="{x}" y1="{y - 4}" x2="{x + 22}" y2="{y - 4}" stroke="{colour}" '
            f'stroke-width="2"{dashing}/><text x="{x + 28}" y="{y}" font-size="11">'
            f"{escape(name)} ({round(sum(values))})</text>"
        )
    parts.append("</svg>")
    return "".join(parts)
