"""Drawing: the SVG line chart, the legend, a bar inside a table cell, the number format."""
from __future__ import annotations

import math
from html import escape

# Strong colours for lines; the first one is also what the browser test looks for.
PALETTE = ["#d1495b", "#00798c", "#edae49", "#30638e", "#66a182", "#8e6c8a", "#e07a5f", "#3d405b"]


def nice_step(span: float, n: int = 4) -> float:
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))


def fmt(v: float) -> str:
    return f"{v:.4g}"


def line_chart(lines: dict[str, list[tuple[int, float]]], width=380, height=160, colours: dict | None = None) -> str:
    """An SVG with one polyline per metric (points = its logged steps), axes with round ticks;
    `colours`: each line's colour by key (default: the palette in order)."""
    left, right, top, bottom = 50, 10, 8, 22
    xs = [x for pts in lines.values() for x, _ in pts]
    ys = [y for pts in lines.values() for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12 * max(1.0, abs(y0)):  # a flat line: give it room above and below
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    ystep = nice_step(y1 - y0)
    y0, y1 = math.floor(y0 / ystep) * ystep, math.ceil(y1 / ystep) * ystep
    xstep = max(1, round(nice_step(max(x1 - x0, 1), 5)))
    pw, ph = width - left - right, height - top - bottom

    def px(x):
        return left + (pw / 2 if x1 == x0 else (x - x0) / (x1 - x0) * pw)

    def py(y):
        return top + ph - (y - y0) / (y1 - y0) * ph

    parts = [f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    for i in range(round((y1 - y0) / ystep) + 1):
        y = y0 + i * ystep
        parts.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{py(y):.1f}" y2="{py(y):.1f}"/>'
                     f'<text class="ylab" x="{left - 4}" y="{py(y) + 3:.1f}">{fmt(y)}</text>')
    for x in range(math.ceil(x0 / xstep) * xstep, x1 + 1, xstep):
        parts.append(f'<text class="xlab" x="{px(x):.1f}" y="{height - 6}">{x}</text>')
    for (key, pts), colour in zip(lines.items(), [colours[k] for k in lines] if colours else cycle(PALETTE)):
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        parts.append(f'<polyline class="series" data-key="{escape(key)}" stroke="{colour}" points="{coords}">'
                     f"<title>{escape(key)}</title></polyline>")
        if len(pts) <= 60:  # dots show which steps were logged (validation runs only every few steps)
            parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}">'
                      f"<title>{escape(key)} at step {x}: {fmt(y)}</title></circle>" for x, y in pts]
    return "".join(parts) + "</svg>"


def cycle(colours):
    while True:
        yield from colours


def legend_html(items: list[tuple[str, str]]) -> str:
    return ('<div class="legend">' + "".join(f'<span><i style="background:{c}"></i>{escape(label)}</span>'
                                             for label, c in items) + "</div>")


def bar_cell(fraction: float, colour: str) -> str:
    fraction = min(max(fraction, 0.0), 1.0)
    return (f'<span class="hbar"><i style="width:{100 * fraction:.1f}%;background:{colour}"></i></span> '
            f"{100 * fraction:.1f}%")
