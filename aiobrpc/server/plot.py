"""A line plot as inline SVG, for the builtin pages: no script, nothing fetched from elsewhere."""

from __future__ import annotations

import html
from collections.abc import Sequence

WIDTH, HEIGHT = 360, 90
_PAD_LEFT, _PAD_RIGHT, _PAD_TOP, _PAD_BOTTOM = 56, 8, 18, 16


def _figure(x: float) -> str:
    if x == int(x) and abs(x) < 1e15:
        return f"{int(x):,}"
    return f"{x:,.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def svg_line(values: Sequence[float], title: str, span: str, slots: int) -> str:
    """`values` (oldest first, at most `slots`) drawn right-aligned over `slots` places, so a
    plot that has not filled yet grows from the right as brpc's do; `span` labels the x axis
    ("60 seconds")."""
    w, h = WIDTH - _PAD_LEFT - _PAD_RIGHT, HEIGHT - _PAD_TOP - _PAD_BOTTOM
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{html.escape(title)}, last {span}">',
             f'<rect x="{_PAD_LEFT}" y="{_PAD_TOP}" width="{w}" height="{h}" fill="#f8f8f8" stroke="#ccc"/>',
             f'<text x="{_PAD_LEFT}" y="12" font-size="11" font-family="sans-serif">'
             f'{html.escape(title)} (last {html.escape(span)})</text>']
    if not values:
        parts.append(f'<text x="{_PAD_LEFT + 6}" y="{_PAD_TOP + h / 2 + 4:.0f}" font-size="11" '
                     f'font-family="sans-serif" fill="#888">no samples yet</text>')
    else:
        top, bottom = max(values), min(0.0, min(values))
        spread = top - bottom or 1.0
        step = w / max(1, slots - 1)
        first = slots - len(values)
        points = " ".join(f"{_PAD_LEFT + (first + i) * step:.1f},{_PAD_TOP + h - (v - bottom) / spread * h:.1f}"
                          for i, v in enumerate(values))
        parts += [f'<polyline fill="none" stroke="#4c72b0" stroke-width="1.5" points="{points}"/>',
                  f'<text x="{_PAD_LEFT - 4}" y="{_PAD_TOP + 9}" font-size="10" font-family="sans-serif" '
                  f'text-anchor="end">{_figure(top)}</text>',
                  f'<text x="{_PAD_LEFT - 4}" y="{_PAD_TOP + h}" font-size="10" font-family="sans-serif" '
                  f'text-anchor="end">{_figure(bottom)}</text>',
                  f'<text x="{WIDTH - _PAD_RIGHT}" y="{HEIGHT - 3}" font-size="10" font-family="sans-serif" '
                  f'text-anchor="end">now: {_figure(values[-1])}</text>']
    parts.append("</svg>")
    return "".join(parts)
