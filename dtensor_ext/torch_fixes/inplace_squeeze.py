"""In-place `squeeze_` that keeps the DTensor's old global shape.

DTensor's dispatch returns `self` unchanged after an in-place op whose output placements equal the input's (the
common `add_`/`mul_` case). `squeeze_` changes the shape without changing the placements when it removes a
size-1 dim that no placement names (a replicated [1] tensor, or dim 1 of a Shard(0) [3, 1] tensor): the local
pieces lose the dim while the DTensor still claims it. `torch.quantile`/`nanquantile` of a 0-d tensor end in
such a `squeeze_` (of their internal [1] result), so they claim shape (1,) for a 0-d result.

The fix gives the three `squeeze_` overloads a handler running DTensor's generic path and then giving `self` the
propagated output spec and the matching sizes, as DTensor's dispatch does when the placements change.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Replicate
from dtensor_ext.torch_fixes import applied_to, swap_handlers, torch_fix

aten = torch.ops.aten

# overload -> its extra arguments squeezing dim 0 of a [1] tensor
_SQUEEZES = {aten.squeeze_.default: (), aten.squeeze_.dim: (0,), aten.squeeze_.dims: ([0],)}


def _squeeze_in_place(op_call, args, kwargs):
    # torch's propagation may rewrite the call to `squeeze_.dims` over the global size-1 dims: run what it chose
    op_info, sharding, schema = _compat.propagate_and_redistribute(op_call, args, kwargs)
    schema.op(*op_info.local_args, **op_info.local_kwargs)
    return _compat.respec_inplace(op_call, args, kwargs, sharding.output_spec)


@functools.cache
def _squeeze_keeps_shape(op) -> bool:
    """Feature check: `op` squeezing a replicated [1] DTensor on a 2-rank probe mesh, run as rank 0, leaves the
    DTensor claiming shape (1,). An overload torch has no strategy for (2.11: all but `squeeze_.dim`) is refused:
    an error, no wrong shape to fix."""
    with _compat.probing_dtensor_ops():
        d = _compat.probe_dtensor(torch.zeros(1), (Replicate(),), (1,))
        try:
            op(d, *_SQUEEZES[op])
        except NotImplementedError:
            return False
        return d.shape != d._local_tensor.shape


@torch_fix(
    "squeeze_ keeps the old shape",
    ops=("aten::squeeze_.default", "aten::squeeze_.dim", "aten::squeeze_.dims"),
    why="an in-place squeeze that leaves the placements alone keeps the DTensor's old global shape around squeezed "
        "pieces (quantile of a 0-d tensor claims shape (1,))",
)
def fix_inplace_squeeze():
    faulty = [op for op in _SQUEEZES if _compat.custom_op_handler(op) is None and _squeeze_keeps_shape(op)]
    if not faulty:
        return None
    return applied_to(faulty, swap_handlers(dict.fromkeys(faulty, _squeeze_in_place)))
