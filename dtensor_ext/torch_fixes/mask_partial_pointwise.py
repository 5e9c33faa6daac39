"""A vocab-sharded embedding output (`_MaskPartial`) is reduced before a linear pointwise op reads it.

torch 2.11's pointwise strategies treat `_MaskPartial` as the `Partial(sum)` it subclasses: a linear op (`e + e`,
`e * r`, `e * 2`, `-e`, a dtype cast, a clone) keeps the placement, and with it the one mask buffer, on its output.
The mask then serves several tensors: the first reduction of any of them releases it, and the next one fails with
torch's bare `AssertionError` in `_MaskPartial._reduce_value` (every HF model on a 2x2 mesh with a vocab-sharded
embedding: RMSNorm's `x * rsqrt(...)` keeps the placement its `x.pow(2)` has just reduced); `e + r` with a
replicated `r` even partitions `r` into the mask that is already there ("MaskBuffer has been materialized with
conflicting data"). 2.12+ reduce a `_MaskPartial` input first (their single-dim rules list `Partial(sum)`, which it
does not match); here these ops are asked as if each `_MaskPartial` input were already reduced, priced as that move,
as `mask_partial_views` does for views. In-place ops are left as torch has them: they cannot move `self`, and torch
keeps the placement of `e.mul_(2)` right. Decided per op by a probe: whether torch's propagation of the op on a
`_MaskPartial` probe spec keeps the placement. Applied before `mask_partial_reads`, which then keeps the mask for the
several reads of one tensor on 2.11 as on 2.12+.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import MaskPartial
from dtensor_ext.torch_fixes import applied_to, torch_fix
from dtensor_ext.torch_fixes.mask_partial_views import reducing_mask_partial_first
from dtensor_ext.torch_fixes.strategy_swap import wrap_strategies

aten = torch.ops.aten

# op -> its probe's arguments after the `_MaskPartial` input (a second `_MaskPartial` read stands for a tensor)
_LINEAR_OPS = {
    aten.add.Tensor: ("masked",), aten.sub.Tensor: ("masked",), aten.mul.Tensor: ("masked",),
    aten.div.Tensor: ("masked",), aten.mul.Scalar: (2.0,), aten.div.Scalar: (2.0,), aten.neg.default: (),
    aten.to.dtype: (torch.float64,), aten._to_copy.default: (), aten.clone.default: (),
}


@functools.cache
def _keeps_mask_partial(op) -> bool:
    """Feature check: torch's sharding propagation of `op` on a (2, 3) `_MaskPartial` probe spec (2-rank probe mesh)
    gives an output that is still `_MaskPartial`."""
    masked = _compat.probe_spec(torch.zeros(2, 3), (MaskPartial(offset_shape=torch.Size([4]), offset_dim=0),))
    rest = tuple(masked if arg == "masked" else arg for arg in _LINEAR_OPS[op])
    out = _compat.output_placements(op, (masked, *rest))
    return out is not None and any(isinstance(p, MaskPartial) for p in out)


@torch_fix(
    "_MaskPartial through linear pointwise ops",
    ops=tuple(_compat.torch_op_names(op)[0] for op in _LINEAR_OPS),
    why="a linear pointwise op keeps a vocab-sharded embedding output _MaskPartial, so one mask serves several "
    "tensors and the second reduction raises AssertionError (every HF model on 2x2 with torch 2.11)",
)
def fix_mask_partial_pointwise():
    ops = [op for op in _LINEAR_OPS if _keeps_mask_partial(op)]
    return applied_to(ops, wrap_strategies(ops, reducing_mask_partial_first)) if ops else None
