"""A strategy that raises where the op only needs one input dim replicated first.

`expand` / `expand_copy` (`torch/distributed/tensor/_ops/_view_ops.py`, registered non-strict: they may
redistribute) is one torch itself shards by redistributing in the neighbouring cases; for one placement its strategy
raises instead of choosing that redistribution. A size-1 dim sharded over n ranks is whole on one rank and empty on
the others; torch's `_ViewShardingPropagator` lets that shard survive analysis, then finds no output dim for it, and
a bare `KeyError` surfaces as "RuntimeError: 1". The fix hands torch's own strategy an input whose broadcast dims are
replicated and charges the move against the real input, so torch still decides everything else; inputs without such
a shard reach torch's strategy untouched.

Aliasing: like torch's `select`/`split`/`slice` on a sharded dim, the result then wraps a replicated copy, not the
input's storage: an in-place change of the input afterwards does not reach it (on one device it would).

Left to torch on purpose: `unbind` along a sharded dim. torch refuses it ("Attempted to unbind along the sharded
dimension", 2.15: "Please redistribute the input explicitly before unbinding") and its own `test_unbind` pins that
refusal: `unbind` returns views of its input, and DTensor refuses by design a view op that would need a
redistribution. The package keeps that refusal (an earlier fix replicated the dim and returned copies); unbind along
an unsharded dim runs as torch runs it. The user moves the input first (`x.redistribute(...)` or `full_tensor()`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, OpSpec, OpStrategy, Replicate, Shard, StridedShard
from dtensor_ext.torch_fixes import applied_to, torch_fix
from dtensor_ext.torch_fixes.strategy_swap import wrap_strategies

aten = torch.ops.aten


def _is_shard_on(p, dims: set[int]) -> bool:
    return isinstance(p, (Shard, StridedShard)) and p.dim in dims


def _replicated_on(spec: DTensorSpec, dims: set[int]) -> DTensorSpec:
    placements = tuple(Replicate() if _is_shard_on(p, dims) else p for p in spec.placements)
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def replicating_first(torch_strategy: Callable, dims_to_replicate: Callable[[OpSchema], set[int]]) -> Callable:
    """torch's strategy, given an input replicated on `dims_to_replicate(schema)` where it is sharded there."""

    def strategy(op_schema: OpSchema):
        source = op_schema.args_schema[0]
        dims = dims_to_replicate(op_schema)
        if not any(_is_shard_on(p, dims) for s in source.strategies for p in s.output_spec.placements):
            return torch_strategy(op_schema)
        replicated = OpStrategy([OpSpec(_replicated_on(s.output_spec, dims)) for s in source.strategies])
        schema = OpSchema(op_schema.op, (replicated, *op_schema.args_schema[1:]), op_schema.kwargs_schema,
                          schema_info=op_schema.schema_info)
        result = torch_strategy(schema)
        for spec in result.strategies:
            spec.redistribute_cost = [_compat.redistribute_costs(source, spec.input_specs[0])]
        return result

    strategy.__wrapped__ = torch_strategy
    return strategy


def broadcast_dims(op_schema: OpSchema) -> set[int]:
    """Input dims of size 1 that `expand(sizes)` stretches."""
    input_shape, sizes = op_schema.args_schema[0].shape, op_schema.args_schema[1]
    offset = len(sizes) - len(input_shape)
    return {
        d
        for d, n in enumerate(input_shape)
        if _compat.known_equal(n, 1)
        and not (_compat.known_equal(sizes[d + offset], 1) or _compat.known_equal(sizes[d + offset], -1))
    }


def _torch_fails_on_sharded_broadcast_dim() -> bool:
    try:
        _, out = _compat.expand_sharding([Shard(0)], (1,), (2,), (2,))
    except (KeyError, AssertionError, RuntimeError):
        return True
    return any(isinstance(p, Shard) for p in out)


@torch_fix(
    "expand of a sharded size-1 dim",
    ops=("aten::expand.default", "aten::expand_copy.default"),
    why="torch's view propagation raises a bare KeyError (RuntimeError: <dim>) instead of replicating the dim",
)
def fix_expand_broadcast():
    # torch 2.11 has no strategy of its own for expand_copy: it decomposes into expand, which this fix covers
    ops = [op for op in (aten.expand.default, aten.expand_copy.default) if _compat.op_strategy_func(op) is not None]
    if not _torch_fails_on_sharded_broadcast_dim() or not ops:
        return None
    undo = wrap_strategies(ops, lambda torch_strategy: replicating_first(torch_strategy, broadcast_dims))
    return applied_to(ops, undo)
