"""What the tuner found, for people: a table of choices, the fitted alpha-beta, and time-vs-size plots
(plain text for the terminal, SVG for a browser; no plotting library needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import groupby
from xml.sax.saxutils import escape

from dtensor_ext.redistribute.calibration_file import NOT_MEASURED
from dtensor_ext.autotune.tuner import TuneResult

__all__ = ["ascii_plots", "format_report", "svg_plots"]

_MARKERS = "ox+*#@"
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _ms(seconds: float) -> str:
    return "-" if seconds == NOT_MEASURED else f"{seconds * 1e3:.3f} ms"


def format_report(result: TuneResult) -> str:
    origin = "from the calibration cache (nothing benchmarked)" if result.cache_hit else "benchmarked"
    lines = [f"autotune {result.key}: {origin}"]
    if result.failure:
        lines.append(f"FAILED, defaults used from then on: {result.failure}")
    rows = [("step", "choice", "median", "default median", "note")]
    for step in result.steps:
        choice = result.entry.choices.get(step.name)
        if choice is None:
            continue
        measured = result.measurements.get(step.name, {})
        default = next(iter(measured), None)
        note = f"fallback: {choice.reason}" if choice.fallback else ""
        rows.append((step.name, choice.implementation, _ms(choice.median_s),
                     _ms(measured[default]) if default else "-", note))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + ("  " + r[4] if r[4] else "") for r in rows]
    lines.append("")
    lines.append("mesh dim  alpha       beta (s/byte)  bandwidth     held-out worst ratio")
    for dim, ab in sorted(result.entry.per_mesh_dim.items()):
        bandwidth = f"{1 / ab.beta_s_per_byte / 1e9:.3f} GB/s" if ab.beta_s_per_byte > 0 else "unbounded"
        held = f"{result.held_out[dim]:.2f}x" if dim in result.held_out else "-"
        lines.append(f"{dim:<9} {ab.alpha_s * 1e6:8.1f} us {ab.beta_s_per_byte:13.3e}  {bandwidth:<13} {held}")
    if not result.entry.per_mesh_dim:
        lines.append("(no fit: fewer than two all-gather sizes measured per mesh dim)")
    return "\n".join(lines)


def _series(result: TuneResult) -> list[tuple[str, dict[str, list[tuple[int, float]]]]]:
    """Per (collective, mesh dims): implementation -> [(bytes, median s)], measured points only."""
    panels = []
    key = lambda s: (s.collective, s.mesh_dims)  # noqa: E731
    for (collective, dims), steps in groupby(sorted(result.steps, key=key), key=key):
        lines: dict[str, list[tuple[int, float]]] = {}
        for step in sorted(steps, key=lambda s: s.nbytes):
            for name, median in result.measurements.get(step.name, {}).items():
                lines.setdefault(name, []).append((step.nbytes, median))
        if lines:
            panels.append((f"{collective} on mesh dims {'+'.join(map(str, dims))}", lines))
    return panels


def _log_scale(values: Sequence[float], cells: int) -> tuple[float, float]:
    lo, hi = math.log10(min(values)), math.log10(max(values))
    return lo, (hi - lo) / (cells - 1) if hi > lo else 1.0


def ascii_plots(result: TuneResult, width: int = 48, height: int = 10) -> str:
    """Log-log time vs message size, one small panel per collective; a letter per implementation."""
    out = []
    for title, lines in _series(result):
        points = [p for pts in lines.values() for p in pts]
        x0, dx = _log_scale([b for b, _ in points], width)
        y0, dy = _log_scale([t for _, t in points], height)
        grid = [[" "] * width for _ in range(height)]
        for marker, pts in zip(_MARKERS, lines.values()):
            for b, t in pts:
                col = round((math.log10(b) - x0) / dx)
                row = height - 1 - round((math.log10(t) - y0) / dy)
                grid[row][col] = marker if grid[row][col] in (" ", marker) else "&"
        top, bottom = 10 ** (y0 + dy * (height - 1)), 10**y0
        out.append(f"{title}  (time vs bytes per rank, log-log; & = overlap)")
        for i, row in enumerate(grid):
            label = _ms(top) if i == 0 else _ms(bottom) if i == height - 1 else ""
            out.append(f"{label:>11} |{''.join(row)}")
        left, right = f"{min(b for b, _ in points)} B", f"{max(b for b, _ in points)} B"
        out.append(" " * 12 + "+" + "-" * width)
        out.append(" " * 13 + left + right.rjust(width - len(left)))
        out.append(" " * 13 + "   ".join(f"{m} {name}" for m, name in zip(_MARKERS, lines)))
        out.append("")
    return "\n".join(out)


def svg_plots(result: TuneResult, panel_w: int = 360, panel_h: int = 240) -> str:
    """The same panels as an SVG document, side by side in rows of three."""
    panels = _series(result)
    cols = 3
    rows = max(1, math.ceil(len(panels) / cols))
    pad = 48
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{cols * panel_w}" height="{rows * panel_h}" '
             'font-family="sans-serif" font-size="11">']
    for i, (title, lines) in enumerate(panels):
        ox, oy = (i % cols) * panel_w, (i // cols) * panel_h
        w, h = panel_w - 2 * pad, panel_h - 2 * pad
        points = [p for pts in lines.values() for p in pts]
        x0, dx = _log_scale([b for b, _ in points], w)
        y0, dy = _log_scale([t for _, t in points], h)
        px = lambda b: ox + pad + (math.log10(b) - x0) / dx  # noqa: E731
        py = lambda t: oy + pad + h - (math.log10(t) - y0) / dy  # noqa: E731
        parts.append(f'<text x="{ox + pad}" y="{oy + 20}">{escape(title)}</text>')
        parts.append(f'<rect x="{ox + pad}" y="{oy + pad}" width="{w}" height="{h}" fill="none" stroke="#999"/>')
        lo_t, hi_t = 10**y0, 10 ** (y0 + dy * (h - 1))
        parts.append(f'<text x="{ox + 2}" y="{oy + pad + 4}">{_ms(hi_t)}</text>')
        parts.append(f'<text x="{ox + 2}" y="{oy + pad + h}">{_ms(lo_t)}</text>')
        parts.append(f'<text x="{ox + pad}" y="{oy + pad + h + 14}">{min(b for b, _ in points)} B</text>')
        parts.append(f'<text x="{ox + pad + w}" y="{oy + pad + h + 14}" text-anchor="end">'
                     f'{max(b for b, _ in points)} B per rank</text>')
        for j, (name, pts) in enumerate(lines.items()):
            color = _COLORS[j % len(_COLORS)]
            coords = " ".join(f"{px(b):.1f},{py(t):.1f}" for b, t in pts)
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5"/>')
            parts.append(f'<text x="{ox + pad + 4 + j * 150}" y="{oy + panel_h - 14}" fill="{color}">'
                         f'{escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
