"""An SVG of a plan: one row per layout (source, then after each step), one tile per rank.

Each tile is the whole tensor (its last two dims; a 1-D tensor is one row) with the part that rank holds filled;
Partial layouts are drawn lighter because the rank holds only a piece of those values.
"""

from __future__ import annotations

from dtensor_ext._compat import Partial
from dtensor_ext.redistribute.layout import Layout
from dtensor_ext.redistribute.placements import format_placements
from dtensor_ext.redistribute.plan import Plan

__all__ = ["plan_svg"]

_TILE, _GAP, _LABEL = 64, 10, 230
_COLOURS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7"]


def _rects(block, shape) -> list[tuple[float, float, float, float]]:
    rows_dim, cols_dim = (len(shape) - 2, len(shape) - 1) if len(shape) >= 2 else (None, 0)
    n_rows = shape[rows_dim] if rows_dim is not None else 1
    n_cols = shape[cols_dim] or 1
    rows = block[rows_dim] if rows_dim is not None else ((0, 1),)
    out = []
    for r0, r1 in rows:
        for c0, c1 in block[cols_dim]:
            out.append((c0 / n_cols, r0 / max(n_rows, 1), (c1 - c0) / n_cols, (r1 - r0) / max(n_rows, 1)))
    return out


def plan_svg(plan: Plan) -> str:
    states = [("source", plan.src)] + [
        (f"{i}. {s.kind} ({','.join(map(str, s.mesh_dims)) or '-'})", s.after) for i, s in enumerate(plan.steps, 1)
    ]
    states = [(label, placements) for label, placements in states if placements is not None]
    world = 1
    for n in plan.mesh_shape:
        world *= n
    width = _LABEL + world * (_TILE + _GAP)
    height = len(states) * (_TILE + 2 * _GAP) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
        'font-size="11">',
        f'<text x="4" y="16">{plan.planner} plan {plan.shape} on mesh {plan.mesh_shape}</text>',
    ]
    for row, (label, placements) in enumerate(states):
        y = 30 + row * (_TILE + 2 * _GAP)
        layout = Layout(plan.shape, plan.mesh_shape, placements)
        partial = any(isinstance(p, Partial) for p in placements)
        parts.append(f'<text x="4" y="{y + 14}">{label}</text>')
        parts.append(f'<text x="4" y="{y + 30}">{format_placements(placements)}</text>')
        for rank in range(world):
            x = _LABEL + rank * (_TILE + _GAP)
            parts.append(f'<rect x="{x}" y="{y}" width="{_TILE}" height="{_TILE}" fill="white" stroke="#999"/>')
            for fx, fy, fw, fh in _rects(layout.blocks[rank], plan.shape):
                parts.append(
                    f'<rect x="{x + fx * _TILE:.1f}" y="{y + fy * _TILE:.1f}" width="{fw * _TILE:.1f}" '
                    f'height="{fh * _TILE:.1f}" fill="{_COLOURS[rank % len(_COLOURS)]}" '
                    f'fill-opacity="{0.45 if partial else 0.9}"/>'
                )
            parts.append(f'<text x="{x + 2}" y="{y + _TILE + 11}">r{rank}</text>')
    parts.append("</svg>")
    return "\n".join(parts)
