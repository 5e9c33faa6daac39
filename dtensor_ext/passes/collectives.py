"""Building blocks for graphs that carry functional collectives (``torch.ops._c10d_functional``).

Functional collectives always scatter and gather along dim 0; a token dim elsewhere is moved to the front by
a view/permute pair around the collective. ``wait_tensor`` counts as side-effectful for FX dead-code
elimination, so dead collectives are removed here explicitly.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "REDUCE_SCATTER",
    "WAIT",
    "all_reduce_waits",
    "eliminate_dead_collectives",
    "insert_all_gather",
    "insert_all_reduce_after",
    "insert_local_slice",
    "insert_rank",
    "insert_reduce_scatter",
    "is_collective",
]

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
ALL_REDUCE = _c10d.all_reduce.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_GATHER = _c10d.all_gather_into_tensor.default
WAIT = _c10d.wait_tensor.default
_COLLECTIVE_NAMESPACE = "_c10d_functional"


def is_collective(node: Node) -> bool:
    target = node.target
    return node.op == "call_function" and getattr(target, "namespace", None) == _COLLECTIVE_NAMESPACE and target != WAIT


def all_reduce_waits(graph: Graph) -> list[tuple[Node, Node]]:
    """(all_reduce, wait_tensor) pairs where the wait is the all_reduce's only user."""
    pairs = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target == ALL_REDUCE and len(node.users) == 1:
            (wait,) = node.users
            if wait.target == WAIT:
                pairs.append((node, wait))
    return pairs


def _shape(node: Node) -> list[int]:
    return list(node.meta["val"].shape)


def _inferred(shape: list) -> list:
    """A view shape with its one symbolic size (a dynamic batch) left for the view to infer (-1)."""
    return [s if isinstance(s, int) else -1 for s in shape]


def _token_dim_to_front(graph: Graph, value: Node, shape: list[int], dim: int, group_size: int) -> Node:
    """[..., T, ...] -> [n * prefix, T / n, ...]: chunk r of the token dim lands in block r of dim 0."""
    split = shape[:dim] + [group_size, shape[dim] // group_size] + shape[dim + 1 :]
    order = [dim, *range(dim), *range(dim + 1, len(split))]
    front = graph.call_function(_aten.view.default, (value, _inferred(split)))
    front = graph.call_function(_aten.permute.default, (front, order))
    front = graph.call_function(_aten.clone.default, (front,), {"memory_format": torch.contiguous_format})
    merged = [group_size * shape[0]] + shape[1:dim] + [shape[dim] // group_size] + shape[dim + 1 :]
    return graph.call_function(_aten.view.default, (front, _inferred(merged)))


def insert_reduce_scatter(graph: Graph, all_reduce: Node, dim: int, group_size: int) -> Node:
    """A reduce_scatter on ``dim`` computing this rank's token shard of ``all_reduce``; returns its wait."""
    source, reduce_op, group_name = all_reduce.args
    shape = _shape(source)
    with graph.inserting_before(all_reduce):
        front = source if dim == 0 else _token_dim_to_front(graph, source, shape, dim, group_size)
        scattered = graph.call_function(REDUCE_SCATTER, (front, reduce_op, group_size, group_name))
        return graph.call_function(WAIT, (scattered,))


def insert_all_gather(graph: Graph, shard: Node, dim: int, group_size: int, group_name, before: Node) -> Node:
    """Every rank's token shard of ``shard`` concatenated on ``dim``, computed just before ``before``.

    ``shard.meta['val']`` still has the full (pre-rewrite) shape."""
    full = _shape(shard)
    local = full[:dim] + [full[dim] // group_size] + full[dim + 1 :]
    with graph.inserting_before(before):
        gathered = graph.call_function(ALL_GATHER, (shard, group_size, group_name))
        waited = graph.call_function(WAIT, (gathered,))
        if dim == 0:
            return waited
        blocks = graph.call_function(_aten.view.default, (waited, _inferred([group_size, *local])))
        order = [*range(1, dim + 1), 0, *range(dim + 1, len(local) + 1)]
        blocks = graph.call_function(_aten.permute.default, (blocks, order))
        blocks = graph.call_function(_aten.clone.default, (blocks,), {"memory_format": torch.contiguous_format})
        return graph.call_function(_aten.view.default, (blocks, _inferred(full)))


def insert_all_reduce_after(graph: Graph, node: Node, group_name) -> Node:
    """Sum ``node`` over the group right after it is computed; every former reader of ``node`` reads the sum."""
    with graph.inserting_after(node):
        reduced = graph.call_function(ALL_REDUCE, (node, "sum", group_name))
    with graph.inserting_after(reduced):
        waited = graph.call_function(WAIT, (reduced,))
    node.replace_all_uses_with(waited, delete_user_cb=lambda user: user is not reduced)
    return waited


# The joint graph is already decomposed: only ops inductor lowers as they are (prims.iota, not aten.arange).
_iota = torch.ops.prims.iota.default


def _iota_kwargs(device: torch.device) -> dict:
    return {"start": 0, "step": 1, "dtype": torch.int64, "device": device, "requires_grad": False}


def insert_rank(graph: Graph, group_size: int, group_name, device: torch.device, before: Node) -> Node:
    """This rank's index in the group as a one-element int64 tensor, computed in the graph (a traced graph is
    shared by every rank, and a compiled one may come from another rank's cache): each rank contributes
    ``arange(n)`` to a reduce_scatter and receives ``n * rank``; (n - 1) * 8 bytes on the wire."""
    with graph.inserting_before(before):
        ranks = graph.call_function(_iota, (group_size,), _iota_kwargs(device))
        scattered = graph.call_function(REDUCE_SCATTER, (ranks, "sum", group_size, group_name))
        waited = graph.call_function(WAIT, (scattered,))
        return graph.call_function(_aten.div.Tensor_mode, (waited, group_size), {"rounding_mode": "floor"})


def insert_local_slice(graph: Graph, full: Node, dim: int, group_size: int, rank: Node, before: Node) -> Node:
    """This rank's token shard of ``full`` (the same on every rank) along ``dim``: a local index, no collective.
    ``full.meta['val']`` holds the full shape."""
    chunk = _shape(full)[dim] // group_size
    with graph.inserting_before(before):
        start = graph.call_function(_aten.mul.Tensor, (rank, chunk))
        offsets = graph.call_function(_iota, (chunk,), _iota_kwargs(full.meta["val"].device))
        index = graph.call_function(_aten.add.Tensor, (offsets, start))
        return graph.call_function(_aten.index.Tensor, (full, [None] * dim + [index]))


def eliminate_dead_collectives(graph: Graph) -> int:
    """Drop waits nobody reads together with their collectives, then ordinary dead code; returns waits removed."""
    removed = 0
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target == WAIT and not node.users:
            (source,) = node.args
            if isinstance(source, Node) and is_collective(source) and len(source.users) == 1:
                graph.erase_node(node)
                removed += 1
    graph.eliminate_dead_code()
    return removed
