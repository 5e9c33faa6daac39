"""An SVG of a plan: one row per layout (source, then after each step), one tile per rank.

Each tile is the whole tensor, every dim of it: the last dim runs left to right, the others top to bottom in
row-major order (a (2, 3, 4) tensor is 6 rows of 4), with a thin line between the blocks of the outermost row dim.
The part the rank holds is filled; Partial layouts are drawn lighter because the rank holds only a piece of those
values. Under each tile: the rank and its mesh coordinate.
"""

from __future__ import annotations

import itertools
import math

from dtensor_ext._compat import Partial
from dtensor_ext.redistribute.layout import Layout, coordinates
from dtensor_ext.redistribute.placements import format_placements
from dtensor_ext.redistribute.plan import Plan

__all__ = ["plan_svg"]

_TILE, _GAP, _LABEL = 64, 20, 230
_COLOURS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7"]


def _rects(block, shape) -> list[tuple[float, float, float, float]]:
    """(x, y, width, height) fractions of a tile covering `block`: rows are the row-major index over every dim
    but the last, columns the last dim."""
    if not shape:
        return [(0.0, 0.0, 1.0, 1.0)]
    n_cols, row_dims = shape[-1] or 1, shape[:-1]
    n_rows = max(math.prod(row_dims), 1)
    row_ranges = []
    # every index combination of the row dims but the innermost, each with the innermost dim's intervals
    for outer in itertools.product(*([i for a, b in intervals for i in range(a, b)] for intervals in block[:-2])):
        base = 0
        for i, n in zip(outer, row_dims[:-1]):
            base = base * n + i
        inner = block[-2] if row_dims else ((0, 1),)
        inner_size = row_dims[-1] if row_dims else 1
        row_ranges += [(base * inner_size + a, base * inner_size + b) for a, b in inner]
    merged: list[tuple[int, int]] = []
    for a, b in sorted(row_ranges):
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        elif b > a:
            merged.append((a, b))
    return [
        (c0 / n_cols, r0 / n_rows, (c1 - c0) / n_cols, (r1 - r0) / n_rows)
        for r0, r1 in merged
        for c0, c1 in block[-1]
    ]


def plan_svg(plan: Plan) -> str:
    states = [("source", plan.src)] + [
        (f"{i}. {s.kind} ({','.join(map(str, s.mesh_dims)) or '-'})", s.after) for i, s in enumerate(plan.steps, 1)
    ]
    states = [(label, placements) for label, placements in states if placements is not None]
    coords = coordinates(plan.mesh_shape)
    world = len(coords)
    width = _LABEL + world * (_TILE + _GAP)
    height = len(states) * (_TILE + 2 * _GAP) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
        'font-size="11">',
        f'<text x="4" y="16">{plan.planner} plan {plan.shape} on mesh {plan.mesh_shape}; tiles: rows = dims '
        f'{_row_dims(plan.shape)} (row-major), columns = dim {max(len(plan.shape) - 1, 0)}; r(rank) (mesh coordinate)</text>',
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
            if len(plan.shape) > 2:  # where the outermost row dim's blocks meet
                per_block = math.prod(plan.shape[1:-1])
                for i in range(1, plan.shape[0]):
                    line_y = y + i * per_block / math.prod(plan.shape[:-1]) * _TILE
                    parts.append(f'<line x1="{x}" y1="{line_y:.1f}" x2="{x + _TILE}" y2="{line_y:.1f}" stroke="#ccc"/>')
            coord = ",".join(map(str, coords[rank]))
            parts.append(f'<text x="{x + 2}" y="{y + _TILE + 11}">r{rank} ({coord})</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _row_dims(shape) -> str:
    return ",".join(map(str, range(len(shape) - 1))) or "-"
