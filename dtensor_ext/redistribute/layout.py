"""Which global elements each rank holds under a placement tuple, as per-dim lists of index intervals.

Written from the meaning of the placements (torch.chunk sizes, mesh dims applied left to right, _StridedShard
splitting into `split_factor` pieces first), so that byte counts and the executor's data movement do not depend
on DTensor's redistribution code.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

from dtensor_ext._compat import Placement, StridedShard
from dtensor_ext.redistribute.placements import is_shard

__all__ = ["Intervals", "Layout", "chunk_sizes", "coordinates", "intersect", "count", "layout_of", "split_block"]

Intervals = tuple[tuple[int, int], ...]  # sorted, disjoint [start, stop) ranges along one tensor dim
Block = tuple[Intervals, ...]  # one Intervals per tensor dim: the elements are their product


def coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Mesh coordinates in rank order (row-major, as init_device_mesh lays ranks out)."""
    return list(itertools.product(*[range(n) for n in mesh_shape]))


def chunk_sizes(size: int, parts: int) -> list[int]:
    """DTensor's Shard layout: torch.chunk sizes, trailing ranks possibly empty."""
    step = -(-size // parts) if size else 0
    sizes = []
    left = size
    for _ in range(parts):
        sizes.append(min(step, left))
        left -= sizes[-1]
    return sizes


def _take(intervals: Intervals, start: int, stop: int) -> Intervals:
    """Positions [start, stop) of the index list that `intervals` spells out."""
    out, seen = [], 0
    for a, b in intervals:
        lo, hi = max(a, a + start - seen), min(b, a + stop - seen)
        if lo < hi:
            out.append((lo, hi))
        seen += b - a
    return tuple(out)


@lru_cache(maxsize=65536)
def _length(intervals: Intervals) -> int:
    return sum(b - a for a, b in intervals)


@lru_cache(maxsize=65536)  # every layout of a plan cuts the same per-dim intervals
def _chunk(intervals: Intervals, parts: int, index: int) -> Intervals:
    sizes = chunk_sizes(_length(intervals), parts)
    start = sum(sizes[:index])
    return _take(intervals, start, start + sizes[index])


def _strided_chunk(intervals: Intervals, split_factor: int, parts: int, index: int) -> Intervals:
    pieces = []
    for outer in range(split_factor):
        pieces.extend(_chunk(_chunk(intervals, split_factor, outer), parts, index))
    return _merge(pieces)


def _merge(pieces) -> Intervals:
    merged: list[list[int]] = []
    for a, b in sorted(pieces):
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


@lru_cache(maxsize=65536)  # planning intersects the same few per-dim interval lists over and over
def intersect(x: Intervals, y: Intervals) -> Intervals:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if lo < hi:
            out.append((lo, hi))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def count(block: Block) -> int:
    return math.prod(_length(d) for d in block)


def split_block(block: Block, parts: int) -> list[Block]:
    """At most `parts` non-empty disjoint pieces covering `block`, cut like torch.chunk along its longest dim."""
    if not block:  # a 0-d tensor's single element
        return [block]
    dim = max(range(len(block)), key=lambda d: _length(block[d]))
    pieces = [block[:dim] + (_chunk(block[dim], parts, i),) + block[dim + 1 :] for i in range(parts)]
    return [p for p in pieces if count(p)]


@dataclass(frozen=True)
class Layout:
    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]

    @cached_property
    def blocks(self) -> list[Block]:
        """rank -> the elements it holds (a value or, on Partial mesh dims, a partial value of them)."""
        return [self._block(c) for c in coordinates(self.mesh_shape)]

    def _block(self, coord: tuple[int, ...]) -> Block:
        dims = [((0, n),) if n else () for n in self.shape]
        for mesh_dim, p in enumerate(self.placements):
            if not is_shard(p):
                continue
            parts, index = self.mesh_shape[mesh_dim], coord[mesh_dim]
            if isinstance(p, StridedShard):
                dims[p.dim] = _strided_chunk(dims[p.dim], p.split_factor, parts, index)
            else:
                dims[p.dim] = _chunk(dims[p.dim], parts, index)
        return tuple(dims)

    @cached_property
    def local_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(_length(d) for d in block) for block in self.blocks]

    def local_numel(self, rank: int) -> int:
        return count(self.blocks[rank])

    @cached_property
    def max_local_numel(self) -> int:
        return max(count(b) for b in self.blocks)

    def overlap(self, rank: int, other: "Layout", other_rank: int) -> Block:
        return tuple(intersect(a, b) for a, b in zip(self.blocks[rank], other.blocks[other_rank]))


@lru_cache(maxsize=4096)
def layout_of(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]) -> Layout:
    """The Layout, built once per process: planning, lower bounds and the engine's decisions read the same ones."""
    return Layout(shape, mesh_shape, placements)
