"""resize_ and resize_as_ where they keep the shape.

DTensor runs an in-place op on each rank's piece and hands back the input DTensor with its old global shape. A
resize that changes the shape would leave that DTensor claiming the old shape over pieces of the new one, so the
rules refuse it (an error naming the op and both shapes) rather than let DTensor's all-Replicate row run it. Keeping
the shape, the resize leaves every piece as it is, provided each rank resizes to the shape of its own piece:
resize_ passes the global size to every rank, so only whole (Replicate or Partial) inputs keep their pieces;
resize_as_ takes each rank's size from the template's piece, so self and template sharded alike also work.
"""

from __future__ import annotations

from dtensor_ext._compat import Partial, Replicate, ShardingPlaceholder
from dtensor_ext.registry import single_dim_rule

FAMILY = "resize"
_KINDS = ("sum", "avg", "max", "min")


def _refuse_shape_change(op, old, new) -> None:
    if tuple(old) != tuple(new):
        raise NotImplementedError(
            f"{op}: resizing a DTensor from {tuple(old)} to {tuple(new)} is not supported (DTensor's in-place path "
            f"would keep the old global shape); resize the local tensor or build a new DTensor"
        )


@single_dim_rule("aten::resize_", family=FAMILY)
def resize_rule(op, args, kwargs):
    self, size = args[0], args[1]
    _refuse_shape_change(op, self.shape, size)
    return [[Partial(k), Partial(k)] for k in _KINDS]


@single_dim_rule("aten::resize_as_", family=FAMILY)
def resize_as_rule(op, args, kwargs):
    """[self (out), self, template]."""
    self, template = args[0], args[1]
    _refuse_shape_change(op, self.shape, template.shape)
    rows = [[ShardingPlaceholder(d)] * 3 for d in range(len(self.shape))]
    whole = [Replicate(), *(Partial(k) for k in _KINDS)]  # a whole template's piece has the global shape
    rows += [[s, s, t] for s in whole for t in whole if not (s == Replicate() and t == Replicate())]
    return rows
