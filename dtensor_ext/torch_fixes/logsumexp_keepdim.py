"""`torch.logsumexp(x, dim, True)`: torch's rule ignores a keepdim passed by position.

torch's logsumexp strategy (`_ops/_math_ops.py`, an op_strategy on 2.13, a single-dim rule on 2.14) reads `keepdim`
only from the kwargs, but DTensor's schema carries it positionally whenever the caller wrote
`torch.logsumexp(x, 0, True)` (or `x.logsumexp(0, keepdim=True)`, which the Python binding also passes by
position). The output placements are then computed for keepdim=False: with `x` sharded on a kept dim the result is
labelled with the wrong dim (wrong values, or a shape error in `full_tensor()`). The fix hands torch's own rule the
keepdim it was given, as a keyword; calls without a positional keepdim reach torch's rule unchanged.
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSpec, OpStrategy, Replicate, Shard
from dtensor_ext.torch_fixes import torch_fix
from dtensor_ext.torch_fixes.strategy_swap import wrap_single_dim_rules, wrap_strategies

aten = torch.ops.aten


def _ignores_positional_keepdim(op) -> bool:
    """Feature check: torch's placements for logsumexp(x, [0], True) of a [2, 2] `x` placed Shard(1) on a 2-rank
    probe mesh differ from those for the same call with keepdim=True passed by keyword."""
    x = _compat.probe_spec(torch.zeros(2, 2), (Shard(1),))
    keyword = _compat.output_placements(op, (x, [0]), {"keepdim": True})
    return _compat.output_placements(op, (x, [0], True)) != keyword


def _keyword_keepdim(args, kwargs):
    if len(args) <= 2:
        return args, kwargs
    return args[:2], {**kwargs, "keepdim": args[2]}


def _single_dim(torch_rule):
    def rule(op, args_meta, kwargs_meta):
        return torch_rule(op, *_keyword_keepdim(args_meta, kwargs_meta))

    return rule


def _replicated_scalar(input_strategy):
    """logsumexp of a 0-d tensor is the tensor itself; 2.13's rule raises on it. Replicate is always right."""
    source = input_strategy.strategies[0].output_spec
    target = DTensorSpec(source.mesh, (Replicate(),) * source.mesh.ndim, tensor_meta=source.tensor_meta)
    return OpStrategy([OpSpec(target, [target], redistribute_cost=[_compat.redistribute_costs(input_strategy, target)])])


def _op_strategy(torch_strategy):
    def strategy(op_schema):
        if op_schema.args_schema[0].ndim == 0:
            return _replicated_scalar(op_schema.args_schema[0])
        args, kwargs = _keyword_keepdim(op_schema.args_schema, op_schema.kwargs_schema)
        return torch_strategy(_compat.OpSchema(op_schema.op, args, kwargs))

    return strategy


@torch_fix(
    "logsumexp ignores positional keepdim",
    ops=("aten::logsumexp.default",),
    why="torch.logsumexp(x, dim, keepdim=True) on a DTensor sharded after the reduced dim gets keepdim=False placements",
)
def fix_logsumexp_keepdim():
    op = aten.logsumexp.default
    if not _ignores_positional_keepdim(op):
        return None
    if _compat.torch_strategy_kind(op) == "single_dim":
        return wrap_single_dim_rules([op], _single_dim)
    return wrap_strategies([op], _op_strategy)
