"""The least any plan can do: bytes each rank must receive and the smallest buffer it must hold.

Without reductions a rank must receive every target element it does not already hold. Where Partial mesh dims
must be reduced, the k partial values of an element must all flow into the first rank that forms its value: k-1
receives if that rank holds a piece, k if not; every other rank that needs the value receives it once more. Over
all ranks that gives the ring all-reduce / reduce-scatter volume (and more where no rank that needs an element
holds a piece of it); no plan's busiest rank receives less than that average, nor less than what it needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dtensor_ext._compat import Partial, Placement, Replicate
from dtensor_ext.redistribute.layout import Layout, coordinates, count, layout_of
from dtensor_ext.redistribute.placements import check_placements, format_placements
from dtensor_ext.redistribute.plan import format_bytes

__all__ = ["LowerBound", "lower_bound", "reduced_dims", "validate_request"]


@dataclass(frozen=True)
class LowerBound:
    recv_bytes_per_rank: tuple[int, ...]  # what each rank alone must receive
    max_recv_bytes: int  # no plan's busiest rank receives less
    peak_bytes: int  # max(source, target) largest local buffer

    def __str__(self) -> str:
        return f"lower bound: max recv {format_bytes(self.max_recv_bytes)}, peak {format_bytes(self.peak_bytes)}"


def mesh_shape_of(mesh) -> tuple[int, ...]:
    shape = tuple(mesh.shape) if hasattr(mesh, "shape") and not isinstance(mesh, (tuple, list)) else tuple(mesh)
    if not shape or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in shape):
        raise ValueError(f"mesh {mesh!r}: expected a DeviceMesh or a tuple of positive mesh dim sizes, e.g. (2, 2)")
    return shape


def validate_request(shape, mesh_shape, src, dst) -> tuple[tuple[int, ...], tuple[Placement, ...], tuple[Placement, ...]]:
    """Shape and both placement tuples checked against each other; raises ValueError naming what is wrong."""
    shape = tuple(shape)
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in shape):
        raise ValueError(f"shape {shape!r}: expected non-negative integer dim sizes")
    src = check_placements(src, shape, mesh_shape, "source placements")
    dst = check_placements(dst, shape, mesh_shape, "target placements")
    for mesh_dim, (s, d) in enumerate(zip(src, dst)):
        if isinstance(d, Partial) and d != s and not isinstance(s, Replicate):
            raise ValueError(
                f"target placements {format_placements(dst)}, mesh dim {mesh_dim}: {d} can only come from "
                f"Replicate or the same Partial, not from {format_placements([s])}"
            )
    return shape, src, dst


def reduced_dims(src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Mesh dims whose Partial values must be combined (size-1 dims hold the full value already)."""
    return tuple(
        i for i, (s, d) in enumerate(zip(src, dst)) if isinstance(s, Partial) and s != d and mesh_shape[i] > 1
    )


def _merge_receives(shape, mesh_shape, before: Layout, after: Layout, dst, pieces: int) -> int:
    """Receives beyond one per needed element: k-1 merges per element, one fewer where a rank that needs the
    element also holds one of its pieces (the merge can end there), counted per class of target Partial coordinates."""
    kept = [j for j, p in enumerate(dst) if isinstance(p, Partial)]
    classes: dict[tuple[int, ...], list[int]] = {}
    for rank, coord in enumerate(coordinates(mesh_shape)):
        classes.setdefault(tuple(coord[j] for j in kept), []).append(rank)
    total = 0
    for members in classes.values():
        # two ranks' blocks are identical or disjoint in any layout, so distinct overlaps never share elements
        overlaps = {after.overlap(rank, before, rank) for rank in members}
        total += math.prod(shape) * (pieces - 1) - sum(count(block) for block in overlaps)
    return total


def lower_bound(shape, mesh, src, dst, dtype: torch.dtype = torch.float32) -> LowerBound:
    mesh_shape = mesh_shape_of(mesh)
    shape, src, dst = validate_request(shape, mesh_shape, src, dst)
    itemsize = torch.empty((), dtype=dtype).element_size()
    before, after = layout_of(shape, mesh_shape, src), layout_of(shape, mesh_shape, dst)
    world = math.prod(mesh_shape)
    reduce = reduced_dims(src, dst, mesh_shape)
    if reduce:
        need = [after.local_numel(r) for r in range(world)]
        pieces = math.prod(mesh_shape[i] for i in reduce)
        total = sum(need) + _merge_receives(shape, mesh_shape, before, after, dst, pieces)
    else:
        need = [after.local_numel(r) - count(after.overlap(r, before, r)) for r in range(world)]
        total = sum(need)
    per_rank = tuple(n * itemsize for n in need)
    busiest = max(max(per_rank), -(-total // world) * itemsize)
    peak = max(before.max_local_numel, after.max_local_numel) * itemsize
    return LowerBound(per_rank, busiest, peak)
