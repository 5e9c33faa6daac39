"""`fill_` must not keep `Partial(sum)`, and `empty_like` of a `Partial(sum)` tensor is better `Replicate`.

torch gives `fill_.Scalar` the identity strategy of `clone`: on a `Partial(sum)` tensor every rank writes the value
and the tensor is then worth `world_size * value`. Only `value == 0` (and the max/min/avg reductions) survive a
fill. With that fixed, `fill_` on `Partial(sum)` is an in-place op that would need a placement change, which DTensor
refuses; the common source of such a tensor is `empty_like` of a `Partial(sum)` one (decompositions such as
cosine_embedding_loss do `empty_like(x).fill_(1)`), so `empty_like` hands out `Replicate` there instead: its values
are unspecified, so any placement is right, and `Replicate` is the one every later fill or random op keeps correct.

Where torch shards both with an op_strategy (2.11-2.13) the fix edits torch's offers instead of replacing them: a
single-dim rule on 2.11 drops every layout with an empty shard (3 columns on 4 ranks), which torch's own strategy
fills in place.
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSpec, OpStrategy, Partial, Replicate, ShardingPlaceholder
from dtensor_ext.torch_fixes import applied_to, replace_rule, torch_fix, undo_all
from dtensor_ext.torch_fixes.strategy_swap import wrap_strategies

aten = torch.ops.aten

_FILL_SAFE_REDUCTIONS = ("max", "min", "avg")  # filling every rank with v reduces to v under these


def _same_on_both_sides(self_meta, partials):
    rows = [[ShardingPlaceholder(d), ShardingPlaceholder(d)] for d in range(len(self_meta.shape))]
    return rows + [[Partial(r), Partial(r)] for r in partials]


def fill_scalar_rule(op, args_meta, kwargs_meta):
    self_meta, value = args_meta[:2]
    return _same_on_both_sides(self_meta, _FILL_SAFE_REDUCTIONS + (("sum",) if value == 0 else ()))


def empty_like_rule(op, args_meta, kwargs_meta):
    self_meta = args_meta[0]
    return _same_on_both_sides(self_meta, _FILL_SAFE_REDUCTIONS) + [[Replicate(), Partial("sum")]]


def _partial_sum_replicated(spec: DTensorSpec) -> DTensorSpec:
    placements = tuple(Replicate() if p == Partial("sum") else p for p in spec.placements)
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def fill_scalar_strategy(torch_strategy):
    """torch's offers less those keeping Partial(sum), unless the value is 0. An in-place fill cannot move its
    input, so a Partial(sum) input with nothing left is refused here (2.13's dispatch checks only the in-place
    layouts of single-dim rules, and would move it without aliasing)."""

    def strategy(op_schema):
        offered = torch_strategy(op_schema)
        if op_schema.args_schema[1] == 0:
            return offered
        kept = [spec for spec in offered.strategies if Partial("sum") not in spec.output_spec.placements]
        if not kept:
            raise RuntimeError(
                f"{op_schema.op}: in-place operations that require placement changes are not supported: filling "
                f"a Partial(sum) tensor with {op_schema.args_schema[1]} needs it Replicate first"
            )
        return OpStrategy(kept)

    return strategy


def empty_like_strategy(torch_strategy):
    """torch's offers, with a Replicate output where torch keeps Partial(sum)."""

    def strategy(op_schema):
        return OpStrategy([
            OpSpec(_partial_sum_replicated(spec.output_spec), spec.input_specs, spec.redistribute_cost)
            for spec in torch_strategy(op_schema).strategies
        ])

    return strategy


def _keeps_partial_sum(op) -> bool:
    """Feature check: whether torch's propagation maps a Partial(sum) [2] tensor (filled with 1.0 for `fill_`) on a
    2-rank probe mesh to a Partial(sum) output."""
    x = _compat.probe_spec(torch.zeros(2), (Partial("sum"),))
    return _compat.output_placements(op, (x, 1.0) if op is aten.fill_.Scalar else (x,)) == (Partial("sum"),)


@torch_fix(
    "fill_ keeps Partial(sum)",
    ops=("aten::fill_.Scalar", "aten::empty_like.default"),
    why="fill_(v) on a Partial(sum) tensor gives world_size * v; empty_like(Partial(sum)) then feeds it",
)
def fix_partial_fill():
    fixes = {
        aten.fill_.Scalar: (fill_scalar_rule, _compat.RuntimeSchemaInfo(1)),
        aten.empty_like.default: (empty_like_rule, _compat.RuntimeSchemaInfo(1, ["dtype"])),
    }
    if not _keeps_partial_sum(aten.fill_.Scalar):
        return None
    faulty = [op for op in fixes if _keeps_partial_sum(op)]
    if all(_compat.torch_strategy_kind(op) == "op_strategy" for op in faulty):
        wrappers = {aten.fill_.Scalar: fill_scalar_strategy, aten.empty_like.default: empty_like_strategy}
        undos = [wrap_strategies([op], wrappers[op], schema_info=fixes[op][1]) for op in faulty]
        return applied_to(faulty, undo_all(undos))
    undos = [replace_rule(op, fixes[op][0], schema_info=fixes[op][1]) for op in faulty]
    return applied_to(faulty, undo_all(undos))
