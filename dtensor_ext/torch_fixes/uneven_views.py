"""A view that flattens or splits an unevenly sharded dim: say exactly what to do instead of only refusing.

A batch of 3 over a data-parallel dim of 2 holds 2 and 1 rows; `x.view(b * s, h)` (what every `nn.Linear` does
to a 3-D input) would hold 2s and s rows, while `Shard(0)` of `b * s` rows means ceil(3s / 2) rows on each of
the first ranks. No placement (and no `_StridedShard`) describes those shards, so no answer both exact and aliasing
exists, and torch's strict view strategy is right to refuse. Its error says to redistribute; the two fixes a user
really has are the package's `view_copies()` (the view becomes a redistributed copy) and a batch the mesh dim
divides. This wrapper re-raises torch's refusal of such a view with both, naming the dim and the sizes; every
other refusal goes through unchanged.

torch checks evenness on global sizes only, so it accepts a view of a dim sharded on two mesh dims whose inner
split is uneven (size 2 over a 2x2 mesh: shards of 1, 0, 1, 0 rows): the view it promises holds other element
counts than the shards it views, and the local kernel fails with a bare "shape is invalid". The wrapper compares
each rank's element counts before and after (`unaliased_layout`) and refuses such a view the same way;
`view_copies()` asks torch again with the dim sharded once, which it then handles by copying.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, OpStrategy, Replicate, Shard
from dtensor_ext.torch_fixes import torch_fix
from dtensor_ext.torch_fixes.strategy_swap import strategy_for_moved_inputs, wrap_strategies

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


# the first way out of every refusal here
_VIEW_COPIES = ("run this code inside `dtensor_ext.view_copies.view_copies()` (the view becomes a redistributed copy "
                "that does not share storage with its input)")


def _local_numels(shape, spec: DTensorSpec) -> list[int]:
    return [math.prod(s) for s in _compat.local_shapes(shape, spec.mesh.shape, spec.placements)]


def _viewed_shape(shape: tuple[int, ...], sizes) -> tuple[int, ...]:
    """The shape `view(sizes)` gives a tensor of `shape` (one -1 inferred), worked out on ints: a view's strategy
    runs while torch.compile traces, where running the view itself on a meta tensor broke the graph."""
    sizes = [int(s) for s in sizes]
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = math.prod(shape) // known if known else 0
    return tuple(sizes)


def unaliased_layout(op_schema: OpSchema, offered: OpStrategy) -> str | None:
    """Where a layout `offered` for the view would give some rank other element counts than the input shard it
    views: which input dim is split how (else None). Symbolic sizes are not checked."""
    shape = tuple(op_schema.args_schema[0].shape)
    if not all(isinstance(s, int) for s in shape):
        return None
    if op_schema.op in _STRICT_VIEW_OPS:
        target = _viewed_shape(shape, op_schema.args_schema[1])
    else:  # the other views `view_copies()` checks (squeeze): their shape from a meta run
        target = tuple(op_schema.op(torch.empty(shape, device="meta"), *op_schema.args_schema[1:]).shape)
    for spec in offered.strategies:
        source = spec.input_specs[0] if spec.input_specs else op_schema.args_schema[0].strategies[0].output_spec
        before, after = _local_numels(shape, source), _local_numels(target, spec.output_spec)
        if before != after:
            shard_counts = Counter(p.dim for p in source.placements if isinstance(p, Shard))
            twice = sorted(d for d, count in shard_counts.items() if count > 1)
            sizes = sorted({s[d] for s in _compat.local_shapes(shape, source.mesh.shape, source.placements)
                            for d in twice})
            return (f"input dims {twice} are sharded on more than one mesh dim ({source.placements} over mesh "
                    f"{tuple(source.mesh.shape)}), into shards of sizes {sizes}; the ranks would view "
                    f"{before} elements as {after}")
    return None


def _sharded_once(spec: DTensorSpec) -> DTensorSpec:
    """`spec` with every tensor dim sharded by its outermost mesh dim only."""
    seen, placements = set(), []
    for p in spec.placements:
        if isinstance(p, Shard) and p.dim in seen:
            p = Replicate()
        elif isinstance(p, Shard):
            seen.add(p.dim)
        placements.append(p)
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def copying_nested_uneven(view_strategy):
    """A non-strict view strategy (`view_copies()`) for inputs whose dims are split unevenly twice over: asked
    again with each dim sharded once, which it then copies where it must."""

    def strategy(op_schema: OpSchema):
        offered = view_strategy(op_schema)
        if unaliased_layout(op_schema, offered) is None:
            return offered
        target = _sharded_once(op_schema.args_schema[0].strategies[0].output_spec)
        offered = strategy_for_moved_inputs(view_strategy, op_schema, {0: target})
        wrong = unaliased_layout(op_schema, offered)
        if wrong is not None:
            raise UnevenViewError(f"{op_schema.op}: no copying layout found: {wrong}")
        return offered

    strategy.__wrapped__ = view_strategy
    return strategy


def explaining_uneven(torch_strategy):
    """torch's strict view strategy; a refusal with an unevenly sharded input says what to do about it, and so
    does a view torch accepts whose shards would not hold what they view."""

    def strategy(op_schema: OpSchema):
        try:
            offered = torch_strategy(op_schema)
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
                f"Either {_VIEW_COPIES}, or make dim {dim} a multiple of {ways} (e.g. pad the batch from {size} to "
                f"{padded}). torch: {e}"
            ) from e
        wrong = unaliased_layout(op_schema, offered)
        if wrong is not None:
            raise UnevenViewError(
                f"{op_schema.op}: view of a tensor of shape {list(op_schema.args_schema[0].shape)} to "
                f"{list(op_schema.args_schema[1])}: {wrong}, and no placement describes the viewed shards as an "
                f"alias of the input's. Either {_VIEW_COPIES}, or shard the dim on one mesh dim."
            )
        return offered

    strategy.__wrapped__ = torch_strategy
    return strategy


@torch_fix(
    "uneven views explained",
    ops=tuple(f"aten::{op.__name__}" for op in _STRICT_VIEW_OPS),
    why="a view of an unevenly sharded dim is refused with 'redistribute', not the view_copies()/pad-the-batch fixes",
)
def fix_uneven_views():
    return wrap_strategies(_STRICT_VIEW_OPS, explaining_uneven)
