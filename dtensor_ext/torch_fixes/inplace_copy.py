"""`self.copy_(src)` where `self` has an empty shard: torch refuses it although moving `src` to `self`'s layout works.

torch's expansion of a single-dim rule keeps a candidate only if every input is "shardable" in it
(`is_tensor_shardable`: at least one row per rank) or already sits in it. When `self` of an in-place copy has an
empty shard (a size-1 dim split over 2 or 4 ranks), the one candidate that keeps `self` asks `src` to take the
same layout, which is not "shardable", so every candidate goes and torch raises "in-place operations that
require placement changes are not supported". Composites that allocate and then fill reach it on small inputs:
`torch.diff(x, n=0)` of a one-element `x` on a 2x2 mesh, `linalg.matrix_power(a, 0)` of a 1x1 `a`. A copy is
elementwise, so `src` moved to `self`'s exact placements (a DTensor redistribution handles empty shards) and
copied piece by piece is the copy, Partial placements included. Only that case changes: equal shapes, `self`
not shardable, `src` elsewhere; everything else is torch's expansion as before.

Left refused: a Partial `src` into a `self` that splits one dim over two mesh dims (`(Shard(0), Shard(0))`), where
torch 2.13's reduce-scatter into the nested empty shards fails (simulated ranks disagree on the result).
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, OpSpec, OpStrategy
from dtensor_ext.torch_fixes import torch_fix
from dtensor_ext.torch_fixes.strategy_swap import expand_single_dim, single_dim_as_op_strategy

aten = torch.ops.aten


def _single_layout(arg: object) -> DTensorSpec | None:
    if isinstance(arg, OpStrategy) and len(arg.strategies) == 1:
        return arg.strategies[0].output_spec
    return None


def _nested_shards(spec: DTensorSpec) -> bool:
    dims = [p.dim for p in spec.placements if p.is_shard()]
    return len(dims) != len(set(dims))


def copy_into_kept_layout(info: object):
    def copy_strategy(op_schema: OpSchema) -> OpStrategy:
        self_spec, src_spec = (_single_layout(a) for a in op_schema.args_schema[:2])
        if (
            self_spec is None
            or src_spec is None
            or self_spec.shape != src_spec.shape
            or src_spec.placements == self_spec.placements
            or _compat.is_tensor_shardable(self_spec.shape, self_spec)
            or (_nested_shards(self_spec) and any(p.is_partial() for p in src_spec.placements))
        ):
            return expand_single_dim(info, op_schema)
        target = DTensorSpec(self_spec.mesh, self_spec.placements, tensor_meta=src_spec.tensor_meta)
        return OpStrategy([OpSpec(
            output_specs=self_spec,
            input_specs=(self_spec, target),
            redistribute_cost=[[0.0], _compat.redistribute_costs(op_schema.args_schema[1], target)],
        )])

    return copy_strategy


@torch_fix(
    "in-place copy into a layout with an empty shard",
    ops=("aten::copy_.default",),
    why="copy_ into a DTensor with an empty shard is refused unless src already has that layout",
)
def fix_copy_into_empty_shards():
    op = aten.copy_.default
    if _compat.torch_strategy_kind(op) != "single_dim" or not _compat.inplace_placement_refusal():
        return None
    return single_dim_as_op_strategy(op, copy_into_kept_layout)
