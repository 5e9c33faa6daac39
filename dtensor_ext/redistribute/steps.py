"""One step between two placement tuples: what moves where, what each rank receives, what it costs.

Data-moving steps are built from the layouts alone: every rank receives exactly the target elements it lacks,
each from the holder closest to it on the mesh, so a step never moves an element twice. Reductions are single
mesh dim all_reduce or reduce_scatter (padded like a ring collective to equal chunks).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from dtensor_ext._compat import Partial, Placement, Replicate, Shard
from dtensor_ext.redistribute.layout import Layout, coordinates, count
from dtensor_ext.redistribute.placements import is_shard
from dtensor_ext.redistribute.plan import Step, Transfer

__all__ = ["StepBuilder", "replace_placement"]


def replace_placement(placements: tuple[Placement, ...], mesh_dim: int, p: Placement) -> tuple[Placement, ...]:
    return placements[:mesh_dim] + (p,) + placements[mesh_dim + 1 :]


class StepBuilder:
    def __init__(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...], dtype: torch.dtype, cost_model):
        self.shape, self.mesh_shape, self.cost = shape, mesh_shape, cost_model
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.coords = coordinates(mesh_shape)
        self.world = len(self.coords)
        self.layout = lru_cache(maxsize=None)(lambda placements: Layout(shape, mesh_shape, placements))
        self.exchange = lru_cache(maxsize=None)(self._exchange)

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
        for dst in range(self.world):
            own = before.blocks[dst]
            holders: dict[tuple, list[int]] = {}
            for src in range(self.world):
                if all(self.coords[src][j] == self.coords[dst][j] for j in kept_partial):
                    holders.setdefault(before.blocks[src], []).append(src)
            for block, ranks in holders.items():
                if block == own:
                    continue
                piece = after.overlap(dst, before, ranks[0])
                if count(piece) == 0:
                    continue
                src = min(ranks, key=lambda r: (self._distance(r, dst), r))
                transfers.append(Transfer(src, dst, piece))
                recv[dst] += count(piece) * self.itemsize
                peers_in[dst].add(src)
                peers_out[src].add(dst)
                spanned.update(j for j in range(len(self.mesh_shape)) if self.coords[src][j] != self.coords[dst][j])
        mesh_dims = tuple(sorted(spanned))
        most = max(recv)
        if not transfers:
            kind, time_s = "local", 0.0
        else:
            grows = all(count(after.overlap(r, before, r)) == before.local_numel(r) for r in range(self.world))
            if grows:
                kind = "all_gather"
            elif max(map(len, peers_in)) <= 1 and max(map(len, peers_out)) <= 1:
                kind = "permute"
            else:
                kind = "all_to_all"
            n = self._group_size(mesh_dims)
            peers = max(map(len, peers_in))
            if kind != "permute" and peers == n - 1:
                time_s = self.cost.collective_time(kind, mesh_dims, -(-most * n // (n - 1)))
            else:  # fewer partners than a ring: one pairwise round per partner
                time_s = peers * self.cost.collective_time("permute", mesh_dims, -(-most // peers))
        return Step(kind, mesh_dims, a, b, tuple(recv), self.buffer_bytes(b), time_s, tuple(transfers))

    def _distance(self, r: int, s: int) -> int:
        return sum(x != y for x, y in zip(self.coords[r], self.coords[s]))

    def all_reduce(self, a: tuple[Placement, ...], mesh_dim: int) -> Step:
        b = replace_placement(a, mesh_dim, Replicate())
        n = self.mesh_shape[mesh_dim]
        layout = self.layout(a)
        local = [layout.local_numel(r) for r in range(self.world)]
        recv = tuple(-(-2 * (n - 1) * m // n) * self.itemsize for m in local)  # whole elements
        largest = max(local) * self.itemsize
        return Step("all_reduce", (mesh_dim,), a, b, recv, largest, self.cost.collective_time("all_reduce", (mesh_dim,), largest))

    def reduce_scatter(self, a: tuple[Placement, ...], mesh_dim: int, tensor_dim: int) -> Step | None:
        """Partial -> Shard(tensor_dim) on one mesh dim; None where inner mesh dims already shard that tensor dim."""
        if any(is_shard(p) and p.dim == tensor_dim for p in a[mesh_dim + 1 :]):
            return None
        if any(is_shard(p) and p.dim == tensor_dim and type(p) is not Shard for p in a):
            return None
        b = replace_placement(a, mesh_dim, Shard(tensor_dim))
        n = self.mesh_shape[mesh_dim]
        layout = self.layout(a)
        recv, padded = [], []
        for r in range(self.world):
            local_shape = layout.local_shapes[r]
            length = local_shape[tensor_dim]
            rest = math.prod(local_shape) // length if length else 0
            chunk = -(-length // n) * rest * self.itemsize
            recv.append((n - 1) * chunk)
            padded.append(n * chunk)
        time_s = self.cost.collective_time("reduce_scatter", (mesh_dim,), max(padded))
        return Step("reduce_scatter", (mesh_dim,), a, b, tuple(recv), self.buffer_bytes(b), time_s, (), tensor_dim)
