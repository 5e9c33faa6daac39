"""`expand` of a size-1 dim that is sharded: replicate that dim first instead of failing.

A size-1 dim sharded over n ranks lives whole on one rank and is empty on the others. torch registers `expand`
and `expand_copy` with its non-strict view strategy (it may redistribute), but its propagator
(`torch/distributed/tensor/_ops/_view_ops.py`, `_ViewShardingPropagator`) lets such a shard survive analysis and
then finds no output dim for it: a bare `KeyError` surfaces as "RuntimeError: 1". The broadcast dim cannot stay
sharded (the empty ranks have nothing to repeat), so the fix hands torch's own strategy an input whose broadcast
dims are replicated and charges the redistribution against the real input. Inputs with no shard on a broadcast
dim go to torch's strategy untouched.

Aliasing: as for every non-strict view strategy of torch, the result of `expand` then wraps a replicated copy,
not the input's storage; an in-place change of the input afterwards does not reach it (on one device it would).
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, OpSpec, OpStrategy, Replicate, Shard, StridedShard
from dtensor_ext.torch_fixes import torch_fix

aten = torch.ops.aten

_EXPAND_OPS = (aten.expand.default, aten.expand_copy.default)


def broadcast_dims(input_shape, sizes) -> set[int]:
    """Input dims of size 1 that `expand(sizes)` stretches."""
    offset = len(sizes) - len(input_shape)
    return {d for d, n in enumerate(input_shape) if n == 1 and sizes[d + offset] not in (1, -1)}


def _replicated_on(spec: DTensorSpec, dims: set[int]) -> DTensorSpec:
    placements = tuple(
        Replicate() if isinstance(p, (Shard, StridedShard)) and p.dim in dims else p for p in spec.placements
    )
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def _expand_strategy(torch_strategy):
    def strategy(op_schema: OpSchema):
        source = op_schema.args_schema[0]
        dims = broadcast_dims(source.shape, op_schema.args_schema[1])
        if not any(
            isinstance(p, (Shard, StridedShard)) and p.dim in dims
            for s in source.strategies
            for p in s.output_spec.placements
        ):
            return torch_strategy(op_schema)
        replicated = OpStrategy([OpSpec(_replicated_on(s.output_spec, dims)) for s in source.strategies])
        schema = OpSchema(op_schema.op, (replicated, *op_schema.args_schema[1:]), op_schema.kwargs_schema)
        result = torch_strategy(schema)
        for spec in result.strategies:
            spec.redistribute_cost = [_compat.generate_redistribute_costs(source, spec.input_specs[0])]
        return result

    strategy.__wrapped__ = torch_strategy
    return strategy


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
    if not _torch_fails_on_sharded_broadcast_dim():
        return None
    snapshots = {op: _compat.snapshot_registration(op) for op in _EXPAND_OPS}
    for op, snapshot in snapshots.items():
        schema_info = snapshot.get("op_to_schema_info")
        _compat.register_op_strategy(op, _expand_strategy(snapshot["op_strategy_funcs"]), schema_info=schema_info)

    def undo():
        for op, snapshot in snapshots.items():
            _compat.restore_registration(op, snapshot)

    return undo
