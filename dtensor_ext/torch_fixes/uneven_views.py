"""A view that flattens or splits an unevenly sharded dim: say exactly what to do instead of only refusing.

A batch of 3 over a data-parallel dim of 2 holds 2 and 1 rows; `x.view(b * s, h)` (what every `nn.Linear` does
to a 3-D input) would hold 2s and s rows, while `Shard(0)` of `b * s` rows means ceil(3s / 2) rows on each of
the first ranks. No placement (and no `_StridedShard`) describes those shards, so no answer both exact and aliasing
exists, and torch's strict view strategy is right to refuse. Its error says to redistribute; the two fixes a user
really has are the package's `view_copies()` (the view becomes a redistributed copy) and a batch the mesh dim
divides. This wrapper re-raises torch's refusal of such a view with both, naming the dim and the sizes; every view
torch accepts, and every other refusal, goes through unchanged.
"""

from __future__ import annotations

import torch

from dtensor_ext._compat import OpSchema, Shard
from dtensor_ext.torch_fixes import torch_fix
from dtensor_ext.torch_fixes.strategy_swap import wrap_strategies

aten = torch.ops.aten

# the strict views: torch refuses rather than copies (reshape, flatten and Linear reach DTensor as aten.view)
_STRICT_VIEW_OPS = (aten.view.default, aten._unsafe_view.default)


class UnevenViewError(RuntimeError):
    """A view of an unevenly sharded dim that no layout can alias."""


def _uneven_dims(op_schema: OpSchema) -> list[tuple[int, int, int, int]]:
    """(tensor dim, its size, mesh dim, mesh dim size) for every shard of the view's input that is uneven."""
    source = op_schema.args_schema[0]
    shape, mesh = tuple(source.shape), source.mesh
    found = []
    for spec in source.strategies:
        for mesh_dim, p in enumerate(spec.output_spec.placements):
            if isinstance(p, Shard) and shape[p.dim] % mesh.size(mesh_dim):
                found.append((p.dim, shape[p.dim], mesh_dim, mesh.size(mesh_dim)))
    return found


def explaining_uneven(torch_strategy):
    """torch's strict view strategy; a refusal with an unevenly sharded input says what to do about it."""

    def strategy(op_schema: OpSchema):
        try:
            return torch_strategy(op_schema)
        except RuntimeError as e:
            uneven = _uneven_dims(op_schema)
            if not uneven:
                raise
            dim, size, mesh_dim, ways = uneven[0]
            padded = -(-size // ways) * ways
            raise UnevenViewError(
                f"{op_schema.op}: view of a tensor of shape {list(op_schema.args_schema[0].shape)} to "
                f"{list(op_schema.args_schema[1])}: dim {dim} (size {size}) is sharded unevenly over mesh dim "
                f"{mesh_dim} (size {ways}), and no placement describes the viewed shards as an alias of the input's. "
                f"Either run this code inside `dtensor_ext.view_copies.view_copies()` (the view becomes a "
                f"redistributed copy that does not share storage with its input), or make dim {dim} a multiple of "
                f"{ways} (e.g. pad the batch from {size} to {padded}). torch: {e}"
            ) from e

    strategy.__wrapped__ = torch_strategy
    return strategy


@torch_fix(
    "uneven views explained",
    ops=tuple(f"aten::{op.__name__}" for op in _STRICT_VIEW_OPS),
    why="a view of an unevenly sharded dim is refused with 'redistribute', not the view_copies()/pad-the-batch fixes",
)
def fix_uneven_views():
    return wrap_strategies(_STRICT_VIEW_OPS, explaining_uneven)
