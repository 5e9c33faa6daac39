"""`x.clamp_(...)` on a Partial tensor: reduce, clamp, and hand the result back in `x`'s own layout.

The clamp of a Partial sum is not the sum of the clamped pieces, so no single-dim row keeps a Partial `self`, and
DTensor refuses in-place ops that would change `self`'s placement: every Partial kind is refused. Composites
reach it: `F.gaussian_nll_loss` clamps `var.clone()` in place, and torch 2.15's `clone` keeps a Partial `var`
Partial (2.13's gathered it, so the loss worked there). The exact in-place answer exists: the out-of-place clamp
(torch reduces the Partial first) laid out again as `self` is laid out (a Partial piece per rank whose reduction
is the clamped value), written into `self`'s local tensor, so `self` and every view of it keep their placements.
Calls without a Partial `self` run DTensor's generic path unchanged, except scalar bounds, which clamp each piece
where it is (any Shard or Replicate layout, empty shards included).
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Partial, Replicate
from dtensor_ext.torch_fixes import applied_to, generic_dispatch, swap_handlers, torch_fix

aten = torch.ops.aten

# in-place clamp -> its out-of-place counterpart
OUT_OF_PLACE = {
    aten.clamp_.default: aten.clamp.default, aten.clamp_.Tensor: aten.clamp.Tensor,
    aten.clamp_min_.default: aten.clamp_min.default, aten.clamp_min_.Tensor: aten.clamp_min.Tensor,
    aten.clamp_max_.default: aten.clamp_max.default, aten.clamp_max_.Tensor: aten.clamp_max.Tensor,
}


def _clamp_partial_in_place(op_call, args, kwargs):
    self = args[0]
    if not any(p.is_partial() for p in self.placements):
        if not any(isinstance(a, _compat.DTensor) for a in (*args[1:], *kwargs.values())):
            # scalar bounds on a sharded or replicated self: elementwise on every piece, in any layout (2.11's
            # strategies keep no layout with an empty shard, 3 rows on 4 ranks, and would move self)
            op_call(self._local_tensor, *args[1:], **kwargs)
            return self
        return generic_dispatch(op_call, args, kwargs)
    value = OUT_OF_PLACE[op_call](*args, **kwargs)
    moved = _compat.dispatch_redistributor()(value._local_tensor, value._spec, self._spec)
    self._local_tensor.copy_(moved)
    return self


def _refuses_partial_self(op) -> bool:
    """Feature check: torch's propagation of `op` on a Partial(sum) [2, 2] tensor on a 2-rank probe mesh (bound a
    scalar or a replicated tensor) finds no strategy keeping `self` Partial(sum) (2.13+ raise there; 2.11 picks
    Replicate, which its dispatch then refuses for an in-place op)."""
    x = torch.zeros(2, 2)
    bound = 0.5 if op._overloadname == "default" else _compat.probe_spec(x, (Replicate(),))
    return _compat.output_placements(op, (_compat.probe_spec(x, (Partial(),)), bound)) != (Partial(),)


@torch_fix(
    "in-place clamp refuses a Partial self",
    ops=tuple(_compat.torch_op_names(op)[0] for op in OUT_OF_PLACE),
    why="x.clamp_() on a Partial x is refused (gaussian_nll_loss clamps a clone of its var in place; torch 2.15's "
    "clone keeps a Partial var Partial); reducing, clamping and re-partitioning into x's layout is exact",
)
def fix_inplace_clamp():
    faulty = [op for op in OUT_OF_PLACE if _compat.custom_op_handler(op) is None and _refuses_partial_self(op)]
    if not faulty:
        return None
    return applied_to(faulty, swap_handlers({op: _clamp_partial_in_place for op in faulty}))
