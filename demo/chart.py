"""The bank report's page: tables and charts as one self-contained HTML page of inline SVG.

Why hand-written SVG rather than matplotlib or plotly: the report needs a few plain charts (grouped bars,
lines, a histogram); matplotlib would add about 40 MB (with numpy, pillow, fonttools) to the demo's
virtualenv and a plotting back end to configure, plotly about 15 MB and a JavaScript bundle in every page.
A page of inline SVG opens in any browser, offline, can be attached to a mail or a ticket, and its content
is testable as text. The functions here are pure (numbers in, markup out); ``demo/report.py`` computes the
numbers with Spark and writes the page next to its Parquet output.

Every chart is drawn in one frame: the title at the top, then a band for the legend, then the plot area
(``<rect class="plot">``), so a legend never covers data. Every bar and point carries its value in a
``<title>`` (shown on hover), and the y axis is labelled at round numbers.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "COLORS",
    "Frame",
    "balance_histogram",
    "bars_svg",
    "histogram_svg",
    "lines_svg",
    "nice_step",
    "nice_ticks",
    "report_html",
    "table_html",
]

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
LEGEND_ROW_PX = 16


@dataclass(frozen=True)
class Frame:
    """A chart's geometry: the whole SVG, and the plot area inside it (title and legend band above it)."""

    width: int = 640
    height: int = 300
    left: int = 64
    right: int = 20
    top: int = 48
    bottom: int = 44

    @property
    def plot_w(self) -> float:
        return self.width - self.left - self.right

    @property
    def plot_h(self) -> float:
        return self.height - self.top - self.bottom

    @property
    def base(self) -> float:
        """The y of the x axis (value 0)."""
        return self.height - self.bottom

    def y(self, value: float, y_max: float) -> float:
        return self.base - self.plot_h * value / y_max


def nice_step(span: float, intervals: int) -> float:
    """The smallest of 1, 2, 2.5 or 5 times a power of ten that cuts ``span`` into at most ``intervals``."""
    raw = max(span, 1e-9) / intervals
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw * (1 - 1e-9))


def nice_ticks(top: float) -> list[float]:
    """Round tick values from 0 to at least ``top`` in 4-6 steps, the last as close to ``top`` as it can."""
    if top <= 0:
        return [0.0, 1.0]
    step = min((nice_step(top, n) for n in (4, 5, 6)), key=lambda s: (math.ceil(top / s - 1e-9) * s, -s))
    return [step * i for i in range(math.ceil(top / step - 1e-9) + 1)]


def _number(value: float) -> str:
    return f"{value:,.0f}" if value == int(value) else f"{value:,.1f}"


def _frame(title: str, x_label: str, y_label: str, ticks: Sequence[float], f: Frame) -> list[str]:
    mid_y = f.top + f.plot_h / 2
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{f.width}" height="{f.height}" role="img" '
        f'aria-label="{html.escape(title)}" font-family="sans-serif" font-size="11">',
        f'<text x="{f.width / 2}" y="16" text-anchor="middle" font-size="14" font-weight="bold">'
        f"{html.escape(title)}</text>",
        f'<rect class="plot" x="{f.left}" y="{f.top}" width="{f.plot_w}" height="{f.plot_h}" fill="none"/>',
        f'<text x="{f.left + f.plot_w / 2}" y="{f.height - 6}" text-anchor="middle">'
        f"{html.escape(x_label)}</text>",
        f'<text x="14" y="{mid_y}" text-anchor="middle" transform="rotate(-90 14 {mid_y})">'
        f"{html.escape(y_label)}</text>",
    ]
    for value in ticks:
        y = f.y(value, ticks[-1])
        parts.append(
            f'<line x1="{f.left}" y1="{y:.1f}" x2="{f.width - f.right}" y2="{y:.1f}" stroke="#e4e4e4"/>'
            f'<text x="{f.left - 6}" y="{y + 4:.1f}" text-anchor="end">{_number(value)}</text>'
        )
    parts.append(
        f'<line x1="{f.left}" y1="{f.base}" x2="{f.width - f.right}" y2="{f.base}" stroke="#333"/>'
        f'<line x1="{f.left}" y1="{f.top}" x2="{f.left}" y2="{f.base}" stroke="#333"/>'
    )
    return parts


def _legend(names: Sequence[str], colors: Mapping[str, str], f: Frame) -> list[str]:
    """Swatches in a row in the band between the title and the plot area (wrapping if they do not fit)."""
    parts, x, row = [], float(f.left), 0
    for name in names:
        item_w = 24 + 6.5 * len(name)
        if x + item_w > f.width - f.right and x > f.left:
            x, row = float(f.left), row + 1
        y = 26 + LEGEND_ROW_PX * row
        parts.append(
            f'<g class="legend"><rect x="{x:.1f}" y="{y}" width="10" height="10" fill="{colors[name]}"/>'
            f'<text x="{x + 14:.1f}" y="{y + 9}">{html.escape(name)}</text></g>'
        )
        x += item_w
    return parts


def bars_svg(
    groups: Mapping[str, Mapping[str, int]],
    colors: Mapping[str, str],
    title: str,
    y_label: str,
    frame: Frame = Frame(),
) -> str:
    """Grouped bars: per group (x axis) one bar per series named in ``colors``, each labelled with its
    value (a bar too small to see still shows its number)."""
    names = list(colors)
    ticks = nice_ticks(max([v for g in groups.values() for v in g.values()] + [1]))
    parts = _frame(title, "", y_label, ticks, frame)
    parts += _legend(names, colors, frame)
    step = frame.plot_w / max(1, len(groups))
    bar_w = min(36.0, (step - 16) / max(1, len(names)))
    for i, (group, values) in enumerate(groups.items()):
        x0 = frame.left + i * step + (step - bar_w * len(names)) / 2
        for k, name in enumerate(names):
            value = values.get(name, 0)
            x, y = x0 + k * bar_w, frame.y(value, ticks[-1])
            parts.append(
                f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{bar_w - 2:.1f}" height="{frame.base - y:.1f}" '
                f'fill="{colors[name]}"><title>{html.escape(group)}, {html.escape(name)}: {value}</title>'
                "</rect>"
                f'<text x="{x + bar_w / 2:.1f}" y="{y - 3:.1f}" text-anchor="middle" font-size="10">'
                f"{value:,}</text>"
            )
        parts.append(
            f'<text x="{frame.left + (i + 0.5) * step:.1f}" y="{frame.base + 16}" text-anchor="middle" '
            f'font-size="12">{html.escape(group)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


def lines_svg(
    series: Mapping[str, Sequence[tuple[int, int]]],
    colors: Mapping[str, str],
    title: str,
    x_label: str,
    y_label: str,
    frame: Frame = Frame(),
    scale: tuple[int, int] | None = None,
) -> str:
    """One line per named series of ``(x, y)`` points over a shared numeric x axis from 0 to the largest
    x, with a legend above the plot. ``scale`` fixes ``(x_top, y_top)`` (small multiples share one)."""
    points = [p for values in series.values() for p in values]
    x_top, y_top = scale or (max([x for x, _ in points] + [1]), max([y for _, y in points] + [1]))
    ticks = nice_ticks(y_top)
    parts = _frame(title, x_label, y_label, ticks, frame)
    parts += _legend(list(series), colors, frame)

    def xy(x: float, y: float) -> tuple[float, float]:
        return frame.left + frame.plot_w * x / max(1, x_top), frame.y(y, ticks[-1])

    step = nice_step(x_top, 5)
    for i in range(int(x_top / step + 1e-9) + 1):
        x, _ = xy(i * step, 0)
        parts.append(
            f'<line x1="{x:.1f}" y1="{frame.base}" x2="{x:.1f}" y2="{frame.base + 4}" stroke="#333"/>'
            f'<text x="{x:.1f}" y="{frame.base + 16}" text-anchor="middle">{_number(i * step)}</text>'
        )
    for name, values in series.items():
        line = " ".join(f"{px:.1f},{py:.1f}" for px, py in (xy(x, y) for x, y in values))
        parts.append(f'<polyline points="{line}" fill="none" stroke="{colors[name]}" stroke-width="2"/>')
        for x, y in values:
            px, py = xy(x, y)
            parts.append(
                f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.5" fill="{colors[name]}">'
                f"<title>{html.escape(name)} at {x:,}: {y:,}</title></circle>"
            )
    parts.append("</svg>")
    return "\n".join(parts)


def balance_histogram(values: Sequence[int], bins: int = 12) -> list[tuple[int, int, int]]:
    """``(low, high, count)`` per bin, ``low <= value < high``: at most ``bins`` bins of a round width
    (:func:`nice_step`) starting at a multiple of it, from the bin of the smallest value to the largest's."""
    if not values:
        return []
    width = max(1, math.ceil(nice_step(max(values) - min(values) + 1, bins)))
    first = min(values) // width
    counts = [0] * (max(values) // width - first + 1)
    for v in values:
        counts[v // width - first] += 1
    return [((first + i) * width, (first + i + 1) * width, c) for i, c in enumerate(counts)]


def histogram_svg(
    bins: Sequence[tuple[int, int, int]], title: str, x_label: str, frame: Frame = Frame()
) -> str:
    """A bar per ``(low, high, count)`` bin, the bins' edges on the x axis."""
    ticks = nice_ticks(max([c for _, _, c in bins] + [1]))
    parts = _frame(title, x_label, "accounts", ticks, frame)
    step = frame.plot_w / max(1, len(bins))
    every = max(1, math.ceil(len(bins) / 8))  # at most 9 edge labels
    for i, (low, high, count) in enumerate(bins):
        x, y = frame.left + i * step, frame.y(count, ticks[-1])
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{step - 2:.1f}" height="{frame.base - y:.1f}" '
            f'fill="{COLORS[0]}"><title>{low:,} to {high:,}: {count}</title></rect>'
        )
        if i % every == 0:
            parts.append(f'<text x="{x:.1f}" y="{frame.base + 16}" text-anchor="middle">{low:,}</text>')
    if bins and len(bins) % every == 0:  # the right edge of the last bin
        x = frame.left + len(bins) * step
        parts.append(f'<text x="{x:.1f}" y="{frame.base + 16}" text-anchor="middle">{bins[-1][1]:,}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def table_html(header: Sequence[str], rows: Sequence[Sequence[object]], caption: str = "") -> str:
    """A table; numbers are right-aligned with thousands separators, a last row of totals is set apart
    when its first cell is ``total``."""

    def cell(value: object, tag: str) -> str:
        if isinstance(value, int) and not isinstance(value, bool):
            return f'<{tag} class="num">{value:,}</{tag}>'
        return f"<{tag}>{html.escape(str(value))}</{tag}>"

    head = "".join(cell(h, "th") for h in header)
    body = "".join(
        f"<tr{' class=total' if r and r[0] == 'total' else ''}>{''.join(cell(v, 'td') for v in r)}</tr>"
        for r in rows
    )
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_STYLE = (
    "body{font-family:sans-serif;margin:1.5em 2em;color:#222}"
    "h1{margin:0 0 .3em}h2{font-size:1.15em;margin:1.4em 0 .4em}h3{font-size:1em;margin:1em 0 .3em}"
    ".lineage{color:#444;margin:.2em 0 1em}.lineage code{background:#f3f3f3;padding:0 .3em}"
    "table{border-collapse:collapse;font-size:13px}caption{text-align:left;font-weight:bold;padding:.3em 0}"
    "th,td{border-bottom:1px solid #ddd;padding:3px 10px}th{background:#f3f3f3}"
    "td.num,th.num{text-align:right}"
    "tr.total td{font-weight:bold;border-top:2px solid #999}"
    ".check.ok{color:#1a7f37}.check.bad{color:#c62828;font-weight:bold}"
    ".grid{display:flex;flex-wrap:wrap;gap:8px 24px}figure{margin:0}"
)


def report_html(title: str, sections: Sequence[str]) -> str:
    """A complete HTML page: the title, then each section (an HTML fragment) in order."""
    body = "\n".join(sections)
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head>\n<body><h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n"
    )
