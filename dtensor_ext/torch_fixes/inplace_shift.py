"""`x.add_(c)` / `x.sub_(c)` on a `Partial(avg/max/min)` tensor: a constant shift commutes with those reductions.

torch's single-dim pointwise rules for `add_` / `sub_` (by a scalar, or by a tensor) offer only `Shard(d)` rows, so an in-place
shift of a `Partial(avg)` tensor (the `mean(x * x).add_(eps)` inside rms_norm when `x` is sharded on the normalized
dim) needs a placement change, which DTensor refuses for in-place ops. Every rank adding `c` shifts the average,
the maximum and the minimum of the pieces by `c`, so those Partials stay valid; `Partial(sum)` does not (it would
add `c` once per rank) and stays refused. A tensor shift must be `Replicate` (the same on every rank). Only the in-place overloads are extended: the out-of-place ones already
work (torch reduces first), and changing their placements would change what torch already does right.
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, OpSpec, OpStrategy, Partial, Replicate
from dtensor_ext.torch_fixes import applied_to, torch_fix
from dtensor_ext.torch_fixes.strategy_swap import wrap_single_dim_rules, wrap_strategies

aten = torch.ops.aten

SHIFT_SAFE_REDUCTIONS = ("avg", "max", "min")


def _with_shift_safe_partials(torch_rule):
    def rule(op, args_meta, kwargs_meta):
        rows = list(torch_rule(op, args_meta, kwargs_meta))
        # a tensor shift must be the same on every rank: Replicate
        shift = [Replicate()] if isinstance(args_meta[1], _compat.TensorMeta) else []
        extra = [[Partial(r), Partial(r), *shift] for r in SHIFT_SAFE_REDUCTIONS]
        return rows + [row for row in extra if row not in rows]

    return rule


def _lacks_shift_safe_partials(op) -> bool:
    torch_rule = _compat.single_dim_func(op)
    if torch_rule is None:
        return False
    rows = torch_rule(op, (_compat.tensor_meta(torch.zeros(2)), 1.0), {})
    return any([Partial(r), Partial(r)] not in rows for r in SHIFT_SAFE_REDUCTIONS)


def _strategy_refuses_shift_safe_partials(op) -> bool:
    """Feature check for a torch sharding `op` with an op_strategy (2.11's pointwise strategies): its propagation of
    a Partial(avg/max/min) [2] tensor shifted by 1 (a scalar, or a replicated tensor) on a 2-rank probe mesh does not
    keep the Partial."""
    if _compat.op_strategy_func(op) is None:
        return False
    shift = 1.0 if op._overloadname == "Scalar" else _compat.probe_spec(torch.ones(2), (Replicate(),))
    return any(
        _compat.output_placements(op, (_compat.probe_spec(torch.zeros(2), (Partial(r),)), shift)) != (Partial(r),)
        for r in SHIFT_SAFE_REDUCTIONS
    )


def _keeping_shift_safe_partials(torch_strategy):
    """torch's op_strategy, plus keeping the layout of a tensor that is replicated or Partial(avg/max/min) on every
    mesh dim (a tensor shift moved to Replicate) where torch offers no such layout."""

    def strategy(op_schema: OpSchema) -> OpStrategy:
        offered = torch_strategy(op_schema)
        target = op_schema.args_schema[0].strategies[0].output_spec
        safe = all(isinstance(p, Replicate) or (isinstance(p, Partial) and p.reduce_op in SHIFT_SAFE_REDUCTIONS)
                   for p in target.placements)
        if not safe or any(s.output_spec.placements == target.placements for s in offered.strategies):
            return offered
        input_specs, costs = [target], [[0.0] * len(op_schema.args_schema[0].strategies)]
        shift = op_schema.args_schema[1]
        if isinstance(shift, OpStrategy):
            replicated = DTensorSpec(target.mesh, (Replicate(),) * target.mesh.ndim, tensor_meta=shift.tensor_meta)
            input_specs.append(replicated)
            costs.append(_compat.redistribute_costs(shift, replicated))
        kept = OpSpec(DTensorSpec(target.mesh, target.placements, tensor_meta=target.tensor_meta), input_specs, costs)
        return OpStrategy([kept, *offered.strategies])

    return strategy


@torch_fix(
    "in-place scalar shift refuses Partial(avg/max/min)",
    ops=("aten::add_.Scalar", "aten::sub_.Scalar", "aten::add_.Tensor", "aten::sub_.Tensor"),
    why="x.add_(c) on Partial(avg) (rms_norm's eps) is refused although the shift commutes with avg/max/min",
)
def fix_inplace_shift():
    shifts = (aten.add_.Scalar, aten.sub_.Scalar, aten.add_.Tensor, aten.sub_.Tensor)
    faulty = [op for op in shifts if _lacks_shift_safe_partials(op)]
    if faulty:
        return wrap_single_dim_rules(faulty, _with_shift_safe_partials)
    faulty = [op for op in shifts if _strategy_refuses_shift_safe_partials(op)]  # 2.11: pointwise op_strategies
    if not faulty:
        return None
    return applied_to(faulty, wrap_strategies(faulty, _keeping_shift_safe_partials))
