"""A vocab-sharded embedding output (`_MaskPartial`) is reduced before a view reshapes it.

`_MaskPartial`'s mask marks the lookups (batch, sequence) each rank did not own, shaped like the embedding output's
leading dims, and is applied to the local tensor when the partial sum is reduced. torch 2.11's view strategies let
the placement through a view: after HF's `F.linear` flattens (2, 16, 64) into (32, 64), the reduction indexes the
(32, 64) shard with the (2, 16) mask (IndexError: every HF model on a 2x2 mesh with a vocab-sharded embedding,
with or without the package). No mask shape can be derived from a view in general (a permutation and a reshape can
give the same local shape), so these ops are asked as if the input were already reduced (Replicate on the mesh dims
where it is `_MaskPartial`), priced as that move: one reduction, which the next nonlinear op would need anyway.
Decided by a probe: whether a view of a `_MaskPartial` probe DTensor keeps the placement.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, MaskPartial, OpSchema, OpStrategy, Replicate
from dtensor_ext.torch_fixes import applied_to, torch_fix
from dtensor_ext.torch_fixes.strategy_swap import strategy_for_moved_inputs, wrap_strategies

aten = torch.ops.aten

_LAYOUT_OPS = (
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.expand.default,
)


def _reduced(spec: DTensorSpec) -> DTensorSpec:
    placements = tuple(Replicate() if isinstance(p, MaskPartial) else p for p in spec.placements)
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def reducing_mask_partial_first(torch_strategy):
    """`torch_strategy` asked as if every `_MaskPartial` tensor argument were already reduced, priced as that move."""

    def strategy(op_schema: OpSchema) -> OpStrategy:
        specs = {i: arg.strategies[0].output_spec for i, arg in enumerate(op_schema.args_schema)
                 if isinstance(arg, OpStrategy)}
        targets = {i: _reduced(spec) for i, spec in specs.items()
                   if any(isinstance(p, MaskPartial) for p in spec.placements)}
        if not targets:
            return torch_strategy(op_schema)
        return strategy_for_moved_inputs(torch_strategy, op_schema, targets)

    strategy.__wrapped__ = torch_strategy
    return strategy


@functools.cache
def _views_keep_mask_partial() -> bool:
    """Feature check on a 2-rank probe mesh: a (2, 2, 4) `_MaskPartial` viewed as (4, 4). Where torch keeps the
    placement, no collective runs; where it reduces first, the probe mesh (no process group) refuses."""
    placement = MaskPartial(offset_shape=torch.Size([8]), offset_dim=0)
    placement.mask_buffer.materialize_mask(torch.tensor([[True, False], [False, True]]))
    with _compat.probing_dtensor_ops():
        try:
            viewed = _compat.probe_dtensor(torch.ones(2, 2, 4), (placement,), (2, 2, 4)).view(4, 4)
        except Exception:  # noqa: BLE001  (torch reduces first: the probe mesh has no group to do it with)
            return False
    return isinstance(viewed.placements[0], MaskPartial)


@torch_fix(
    "_MaskPartial through views",
    ops=tuple(f"aten::{op._schema.name.partition('::')[2]}.{op._overloadname}" for op in _LAYOUT_OPS),
    why="a view keeps a vocab-sharded embedding output _MaskPartial with its mask shaped for the unviewed tensor: "
    "the reduction after HF's linear flattening raises IndexError (2.11)",
)
def fix_mask_partial_views():
    if not _views_keep_mask_partial():
        return None
    ops = [op for op in _LAYOUT_OPS if _compat.torch_strategy_kind(op) == "op_strategy"]
    return applied_to(ops, wrap_strategies(ops, reducing_mask_partial_first)) if ops else None
