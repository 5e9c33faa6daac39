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
from dtensor_ext._compat import Partial, Replicate
from dtensor_ext.torch_fixes import torch_fix
from dtensor_ext.torch_fixes.strategy_swap import wrap_single_dim_rules

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


@torch_fix(
    "in-place scalar shift refuses Partial(avg/max/min)",
    ops=("aten::add_.Scalar", "aten::sub_.Scalar", "aten::add_.Tensor", "aten::sub_.Tensor"),
    why="x.add_(c) on Partial(avg) (rms_norm's eps) is refused although the shift commutes with avg/max/min",
)
def fix_inplace_shift():
    shifts = (aten.add_.Scalar, aten.sub_.Scalar, aten.add_.Tensor, aten.sub_.Tensor)
    faulty = [op for op in shifts if _lacks_shift_safe_partials(op)]
    if not faulty:
        return None
    return wrap_single_dim_rules(faulty, _with_shift_safe_partials)
