"""One step between two placement tuples: what moves where, what each rank receives, what it costs.

Data-moving steps are built from the layouts alone: every rank receives exactly the target elements it lacks,
each from the holder closest to it on the mesh, so a step never moves an element twice. Reductions are single
mesh dim all_reduce or reduce_scatter (padded like a ring collective to equal chunks), or a reduce_exchange
that reduces several Partial mesh dims and moves to the target at once: every element's pieces go to ranks that
hold one (ranks that need the element where any holds a piece), split evenly among them, and the sums go
straight to the ranks that need them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from functools import lru_cache

import torch

from dtensor_ext._compat import Partial, Placement, Replicate, Shard
from dtensor_ext.redistribute.layout import Layout, coordinates, count, intersect, layout_of, split_block
from dtensor_ext.redistribute.placements import is_shard
from dtensor_ext.redistribute.plan import Merge, Step, Transfer

__all__ = ["StepBuilder", "replace_placement"]


def replace_placement(placements: tuple[Placement, ...], mesh_dim: int, p: Placement) -> tuple[Placement, ...]:
    return placements[:mesh_dim] + (p,) + placements[mesh_dim + 1 :]


class StepBuilder:
    def __init__(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...], dtype: torch.dtype, cost_model):
        self.shape, self.mesh_shape, self.cost, self.dtype = shape, mesh_shape, cost_model, dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.coords = coordinates(mesh_shape)
        self.world = len(self.coords)
        # distances[r][s]: the mesh dims on which ranks r and s differ (the nearest holder sends), one table per
        # builder: a 64-rank move asks for thousands of them
        self.distances = [[sum(x != y for x, y in zip(c, d)) for d in self.coords] for c in self.coords]
        self.layout = lru_cache(maxsize=None)(self._layout)
        self.exchange = lru_cache(maxsize=None)(self._exchange)
        # deterministic measure of planning effort (rank pairs examined), which bounds the planner's search
        self.work = 0

    def _layout(self, placements) -> Layout:
        self.work += self.world
        return layout_of(self.shape, self.mesh_shape, placements)

    def buffer_bytes(self, placements) -> int:
        return self.layout(placements).max_local_numel * self.itemsize

    def _group_size(self, mesh_dims) -> int:
        return math.prod(self.mesh_shape[d] for d in mesh_dims)

    def _exchange(self, a: tuple[Placement, ...], b: tuple[Placement, ...]) -> Step | None:
        """Move from layout `a` to `b` without reducing; None where Partial values would have to be combined."""
        for pa, pb in zip(a, b):
            if isinstance(pa, Partial) and pa != pb:
                return None
            if isinstance(pb, Partial) and pb != pa and not isinstance(pa, Replicate):
                return None
        before, after = self.layout(a), self.layout(b)
        kept_partial = [j for j, p in enumerate(a) if isinstance(p, Partial)]
        transfers, recv = [], [0] * self.world
        peers_in, peers_out = [set() for _ in range(self.world)], [set() for _ in range(self.world)]
        spanned = set()
        holders_by_class: dict[tuple, dict[tuple, list[int]]] = {}
        for src in range(self.world):
            partial_coord = tuple(self.coords[src][j] for j in kept_partial)
            holders_by_class.setdefault(partial_coord, {}).setdefault(before.blocks[src], []).append(src)
        indexes = {key: _BlockIndex(holders) for key, holders in holders_by_class.items()}
        self.work += self.world
        for dst in range(self.world):
            own = before.blocks[dst]
            index = indexes[tuple(self.coords[dst][j] for j in kept_partial)]
            for block, ranks, piece in index.overlapping(after.blocks[dst]):
                self.work += 1
                if block == own:
                    continue
                src = _nearest(ranks, self.distances[dst])
                transfers.append(Transfer(src, dst, piece))
                recv[dst] += count(piece) * self.itemsize
                peers_in[dst].add(src)
                peers_out[src].add(dst)
                spanned.update(j for j in range(len(self.mesh_shape)) if self.coords[src][j] != self.coords[dst][j])
        mesh_dims = tuple(sorted(spanned))
        if not transfers:
            kind, time_s = "local", 0.0
        else:
            grows = all(count(after.overlap(r, before, r)) == before.local_numel(r) for r in range(self.world))
            kind = "all_gather" if grows else self._move_kind(peers_in, peers_out)
            time_s = self._move_time(kind, mesh_dims, recv, peers_in)
        return Step(kind, mesh_dims, a, b, tuple(recv), self.buffer_bytes(b), time_s, tuple(transfers))

    @staticmethod
    def _move_kind(peers_in, peers_out) -> str:
        return "permute" if max(map(len, peers_in)) <= 1 and max(map(len, peers_out)) <= 1 else "all_to_all"

    def _move_time(self, kind: str, mesh_dims, recv, peers_in) -> float:
        most, peers = max(recv), max(map(len, peers_in))
        if not peers:
            return 0.0
        if kind != "permute" and peers == self._group_size(mesh_dims) - 1:
            return self._group_time(kind, mesh_dims, most)
        # fewer partners than a ring: one pairwise round per partner
        return peers * self.cost.collective_time("permute", mesh_dims, -(-most // peers))

    def as_collective(self, step: Step, kind: str) -> Step:
        """`step`'s moves run as one `kind` collective over its mesh dims, whatever their pattern (how torch runs
        some moves: Shard(i) -> Shard(j) is an all_to_all even where each rank only swaps with one other)."""
        if step.kind == kind or not step.transfers:
            return step
        time_s = self._group_time(kind, step.mesh_dims, max(step.recv_bytes))
        return dataclasses.replace(step, kind=kind, time_s=time_s)

    def _group_time(self, kind: str, mesh_dims, most: int) -> float:
        """One `kind` collective over the whole group of `mesh_dims` in which a rank receives at most `most` bytes
        (the cost model's bytes per rank: what each of the n ranks holds, n / (n - 1) of what one receives)."""
        n = self._group_size(mesh_dims)
        return self.cost.collective_time(kind, mesh_dims, -(-most * n // (n - 1)))

    def all_reduce(self, a: tuple[Placement, ...], mesh_dim: int) -> Step:
        return self.all_reduce_over(a, (mesh_dim,))

    def all_reduce_over(self, a: tuple[Placement, ...], mesh_dims: tuple[int, ...]) -> Step:
        """Partial -> Replicate on `mesh_dims` (one all_reduce on their flattened group where several)."""
        b = tuple(Replicate() if j in mesh_dims else p for j, p in enumerate(a))
        n = self._group_size(mesh_dims)
        layout = self.layout(a)
        self.work += self.world
        local = [layout.local_numel(r) for r in range(self.world)]
        recv = tuple(-(-2 * (n - 1) * m // n) * self.itemsize for m in local)  # whole elements
        largest = max(local) * self.itemsize
        return Step("all_reduce", mesh_dims, a, b, recv, largest, self.cost.collective_time("all_reduce", mesh_dims, largest))

    def reduce_scatter(self, a: tuple[Placement, ...], mesh_dim: int, tensor_dim: int) -> Step | None:
        """Partial -> Shard(tensor_dim) on one mesh dim; None where inner mesh dims already shard that tensor dim."""
        if any(is_shard(p) and p.dim == tensor_dim for p in a[mesh_dim + 1 :]):
            return None
        if any(is_shard(p) and p.dim == tensor_dim and type(p) is not Shard for p in a):
            return None
        return self.reduce_scatter_over(a, (mesh_dim,), tensor_dim)

    def reduce_scatter_over(self, a: tuple[Placement, ...], mesh_dims: tuple[int, ...], tensor_dim: int) -> Step:
        """Partial -> Shard(tensor_dim) on `mesh_dims`: one padded chunk per member of their (flattened) group."""
        b = tuple(Shard(tensor_dim) if j in mesh_dims else p for j, p in enumerate(a))
        n = self._group_size(mesh_dims)
        layout = self.layout(a)
        self.work += self.world
        recv, padded = [], []
        for r in range(self.world):
            local_shape = layout.local_shapes[r]
            length = local_shape[tensor_dim]
            rest = math.prod(local_shape) // length if length else 0
            chunk = -(-length // n) * rest * self.itemsize
            recv.append((n - 1) * chunk)
            padded.append(n * chunk)
        time_s = self.cost.collective_time("reduce_scatter", mesh_dims, max(padded))
        return Step("reduce_scatter", mesh_dims, a, b, tuple(recv), self.buffer_bytes(b), time_s, (), tensor_dim)

    def reduce_exchange(self, a: tuple[Placement, ...], b: tuple[Placement, ...]) -> Step | None:
        """Reduce every Partial mesh dim of `a` that `b` drops and land in `b`: one all-to-all of partial pieces
        to the merging ranks, a local reduction, one all-to-all of the results. None where `b` adds a Partial or
        the dropped Partials mix reduce ops (their order would matter)."""
        reduced = [j for j, (p, q) in enumerate(zip(a, b)) if isinstance(p, Partial) and p != q]
        if not reduced or len({a[j].reduce_op for j in reduced}) > 1:
            return None
        if any(isinstance(q, Partial) and q != p for p, q in zip(a, b)):
            return None
        before, after = self.layout(a), self.layout(b)
        kept = [j for j, p in enumerate(b) if isinstance(p, Partial)]
        classes: dict[tuple[int, ...], list[int]] = {}
        for rank, coord in enumerate(self.coords):
            classes.setdefault(tuple(coord[j] for j in kept), []).append(rank)
        merges, transfers = [], []
        gathered, recv = [0] * self.world, [0] * self.world
        peers = {phase: ([set() for _ in range(self.world)], [set() for _ in range(self.world)]) for phase in (1, 2)}
        spanned = set()

        def send(phase, src, dst, elements):
            (recv if phase == 2 else gathered)[dst] += elements * self.itemsize
            peers[phase][0][dst].add(src)
            peers[phase][1][src].add(dst)
            spanned.update(j for j in range(len(self.mesh_shape)) if self.coords[src][j] != self.coords[dst][j])

        self.work += self.world * len(set(before.blocks))
        for members in classes.values():
            needers, holders = self._group_by_block(after, members), self._group_by_block(before, members)
            for target_block, needing in needers.items():
                for source_block, holding in holders.items():
                    atom = tuple(intersect(x, y) for x, y in zip(target_block, source_block))
                    if not count(atom):
                        continue
                    pieces: dict[tuple[int, ...], list[int]] = {}
                    for r in holding:
                        pieces.setdefault(tuple(self.coords[r][j] for j in reduced), []).append(r)
                    mergers = [r for r in needing if r in holding] or holding
                    for merger, chunk in zip(mergers, split_block(atom, len(mergers))):
                        own = tuple(self.coords[merger][j] for j in reduced)
                        sources = tuple(
                            _nearest(ranks, self.distances[merger])
                            for key, ranks in sorted(pieces.items())
                            if key != own
                        )
                        merges.append(Merge(merger, chunk, sources, merger in needing))
                        for src in sources:
                            send(1, src, merger, count(chunk))
                        for dst in needing:
                            if dst != merger:
                                transfers.append(Transfer(merger, dst, chunk))
                                send(2, merger, dst, count(chunk))
        mesh_dims = tuple(sorted(spanned))
        time_s = sum(
            self._move_time(self._move_kind(*peers[phase]), mesh_dims, per_rank, peers[phase][0])
            for phase, per_rank in ((1, gathered), (2, recv))
        )
        total = tuple(x + y for x, y in zip(gathered, recv))
        buffer = max(self.buffer_bytes(b), max(gathered))  # the pieces a merging rank holds before reducing them
        return Step("reduce_exchange", mesh_dims, a, b, total, buffer, time_s, tuple(transfers), merges=tuple(merges))

    @staticmethod
    def _group_by_block(layout: Layout, ranks) -> dict[tuple, list[int]]:
        """Non-empty local block -> the ranks (among `ranks`) holding it."""
        out: dict[tuple, list[int]] = {}
        for r in ranks:
            if layout.local_numel(r):
                out.setdefault(layout.blocks[r], []).append(r)
        return out


def _nearest(ranks: list[int], distance: list[int]) -> int:
    """The rank of `ranks` nearest by `distance` (one rank's row of StepBuilder.distances), the lowest on ties."""
    best = min(map(distance.__getitem__, ranks))
    return min(r for r in ranks if distance[r] == best)


class _BlockIndex:
    """Source blocks found by their per-dim intervals, so that a target block meets only the blocks it overlaps
    (on a 64-rank mesh a handful, not 64)."""

    def __init__(self, holders: dict[tuple, list[int]]):
        self.holders = holders
        ndim = len(next(iter(holders)))
        self.per_dim = [sorted({block[d] for block in holders}) for d in range(ndim)]

    def overlapping(self, target: tuple):
        """(block, its ranks, its non-empty overlap with `target`) for every source block meeting `target`."""
        meets = []
        for d, intervals in enumerate(self.per_dim):
            meets.append([(x, cut) for x in intervals if (cut := intersect(x, target[d]))])
        for combo in itertools.product(*meets):
            block = tuple(x for x, _ in combo)
            ranks = self.holders.get(block)
            if ranks is not None:
                yield block, ranks, tuple(cut for _, cut in combo)
