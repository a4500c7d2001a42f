"""The bank report's charts as one self-contained HTML page of inline SVG (no dependency, no network).

Why hand-written SVG rather than matplotlib or plotly: the report needs two plain charts (a histogram and
one line per partition); matplotlib would add about 40 MB (with numpy, pillow, fonttools) to the demo's
virtualenv and a plotting back end to configure, plotly about 15 MB and a JavaScript bundle in every page.
A page of inline SVG opens in any browser, offline, can be attached to a mail or a ticket, and its content
is testable as text. The functions here are pure (numbers in, markup out); ``demo/report.py`` computes the
numbers with Spark and writes the page next to its Parquet output.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

__all__ = ["balance_histogram", "histogram_svg", "lines_svg", "report_html"]

WIDTH, HEIGHT = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 60, 20, 30, 50
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def balance_histogram(values: Sequence[int], bins: int = 12) -> list[tuple[int, int, int]]:
    """``(low, high, count)`` per bin, ``low <= value < high`` (the last bin includes its high)."""
    if not values:
        return []
    low, high = min(values), max(values)
    width = max(1, math.ceil((high - low + 1) / bins))
    counts = [0] * bins
    for v in values:
        counts[min((v - low) // width, bins - 1)] += 1
    return [(low + i * width, low + (i + 1) * width, counts[i]) for i in range(bins)]


def _frame(title: str, x_label: str, y_label: str, y_max: int) -> list[str]:
    plot_h = HEIGHT - TOP - BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{html.escape(title)}" font-family="sans-serif" font-size="11">',
        f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" font-size="14">{html.escape(title)}</text>',
        f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}" '
        'stroke="#333"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}" stroke="#333"/>',
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 8}" text-anchor="middle">{html.escape(x_label)}</text>',
        f'<text x="14" y="{TOP + plot_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {TOP + plot_h / 2})">{html.escape(y_label)}</text>',
    ]
    for i in range(5):  # y grid: 0, 1/4 ... max
        value = y_max * i / 4
        y = HEIGHT - BOTTOM - plot_h * i / 4
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{value:.0f}</text>')
    return parts


def histogram_svg(bins: Sequence[tuple[int, int, int]], title: str, x_label: str) -> str:
    """A bar per ``(low, high, count)`` bin."""
    y_max = max([c for _, _, c in bins] + [1])
    parts = _frame(title, x_label, "accounts", y_max)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = plot_w / max(1, len(bins))
    for i, (low, high, count) in enumerate(bins):
        h = plot_h * count / y_max
        x = LEFT + i * step
        parts.append(
            f'<rect x="{x + 2:.1f}" y="{HEIGHT - BOTTOM - h:.1f}" width="{step - 4:.1f}" height="{h:.1f}" '
            f'fill="{COLORS[0]}"><title>{low} to {high}: {count}</title></rect>'
        )
        if i % 2 == 0 or len(bins) <= 8:
            parts.append(
                f'<text x="{x + step / 2:.1f}" y="{HEIGHT - BOTTOM + 14}" text-anchor="middle">{low}</text>'
            )
    parts.append("</svg>")
    return "\n".join(parts)


def lines_svg(series: Mapping[str, Sequence[int]], x_labels: Sequence[str], title: str, x_label: str) -> str:
    """One line (with points) per named series over the same x positions, and a legend."""
    y_max = max([v for values in series.values() for v in values] + [1])
    parts = _frame(title, x_label, "operations", y_max)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    n = max(1, len(x_labels))
    step = plot_w / n

    def xy(i: int, v: int) -> tuple[float, float]:
        return LEFT + step * (i + 0.5), HEIGHT - BOTTOM - plot_h * v / y_max

    for i, label in enumerate(x_labels):
        x, _ = xy(i, 0)
        if i % 2 == 0 or n <= 6:
            parts.append(
                f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 14}" text-anchor="middle">'
                f"{html.escape(label)}</text>"
            )
    for k, (name, values) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in enumerate(values)))
        parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        for i, v in enumerate(values):
            x, y = xy(i, v)
            parts.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}">'
                f"<title>{html.escape(name)}, {html.escape(x_labels[i])}: {v}</title></circle>"
            )
        parts.append(
            f'<rect x="{WIDTH - RIGHT - 110}" y="{TOP + 14 * k}" width="10" height="10" fill="{color}"/>'
            f'<text x="{WIDTH - RIGHT - 96}" y="{TOP + 9 + 14 * k}">{html.escape(name)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


def report_html(title: str, summary: Sequence[str], charts: Sequence[str]) -> str:
    """A complete HTML page: a title, summary lines, then the charts."""
    lines = "".join(f"<li>{html.escape(s)}</li>" for s in summary)
    body = "\n".join(f"<figure>{c}</figure>" for c in charts)
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        "<style>body{font-family:sans-serif;margin:2em}figure{margin:1em 0}</style></head>\n"
        f"<body><h1>{html.escape(title)}</h1><ul>{lines}</ul>\n{body}\n</body></html>\n"
    )
