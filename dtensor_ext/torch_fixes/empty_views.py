"""Views of tensors with no elements: torch's view propagation refuses some and hangs on others.

torch's `view_groups` (`torch/distributed/tensor/_ops/_view_ops.py`), which maps the input dims of a
view/reshape to the output dims, treats a size-0 dim as droppable: `view` of a `[0, 4]` tensor sharded on dim 0
to `[-1, 4]` (its own shape) is refused with "This operation would remove or reshape sharded dimension 0"
(`F.bilinear` on an empty batch does this), and `view(0, 3)` of a `[3, 0]` tensor never returns, whatever its
placement. An empty tensor has no element whose aliasing could be observed, so the fix keeps the placements
where the view keeps the shape and otherwise replicates input and output (moving no data). Views of tensors with
elements go to torch's strategy untouched.
"""

from __future__ import annotations

import math

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, OpSpec, OpStrategy, Replicate
from dtensor_ext.torch_fixes import applied_to, torch_fix
from dtensor_ext.torch_fixes.strategy_swap import wrap_strategies

aten = torch.ops.aten

_VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)


def _target_shape(shape: tuple[int, ...], sizes) -> tuple[int, ...] | None:
    """The view's shape with -1 resolved, or None where -1 is ambiguous (torch itself refuses those)."""
    sizes = tuple(sizes)
    if -1 not in sizes:
        return sizes
    known = math.prod(s for s in sizes if s != -1)
    return None if known == 0 else tuple(0 if s == -1 else s for s in sizes)


def _empty_view_strategy(source: OpStrategy, target: tuple[int, ...]) -> OpStrategy:
    strategies = []
    for s in source.strategies:
        spec = s.output_spec
        same_shape = target == tuple(source.shape)
        placements = spec.placements if same_shape else tuple(Replicate() for _ in spec.placements)
        input_spec = DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)
        strategies.append(
            OpSpec(
                output_specs=DTensorSpec(spec.mesh, placements),
                input_specs=(input_spec,),
                redistribute_cost=[_compat.redistribute_costs(source, input_spec)],
            )
        )
    return OpStrategy(strategies)


def empty_aware(torch_strategy):
    """torch's view strategy, except for inputs with no elements (kept in place, or replicated)."""

    def strategy(op_schema: OpSchema):
        source = op_schema.args_schema[0]
        shape = tuple(source.shape)
        if not _compat.known_equal(math.prod(shape), 0):  # symbolic sizes are never guarded on here
            return torch_strategy(op_schema)
        target = _target_shape(shape, op_schema.args_schema[1])
        return torch_strategy(op_schema) if target is None else _empty_view_strategy(source, target)

    strategy.__wrapped__ = torch_strategy
    return strategy


@torch_fix(
    "views of empty tensors",
    ops=tuple(f"aten::{op.__name__}" for op in _VIEW_OPS),
    why="view_groups drops size-0 dims: identity views of empty tensors are refused, some views never return",
)
def fix_empty_views():
    if not _compat.view_groups_drops_empty_dims():
        return None
    # torch 2.11 has no strategy of its own for view_copy (it decomposes into view, which this fix covers)
    ops = [op for op in _VIEW_OPS if _compat.torch_strategy_kind(op) == "op_strategy"]
    return applied_to(ops, wrap_strategies(ops, empty_aware))
