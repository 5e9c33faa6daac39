"""`torch.allclose` of DTensors: answered from the shards by `isclose(...).all()`, one scalar all-reduce.

`aten.allclose` returns a Python bool read off the data. torch 2.13 has no strategy for it, so DTensor's
decomposition fallback runs it on fake tensors, which cannot produce data ("DataDependentOutputException"): every
call fails, even on replicated inputs. `allclose(a, b)` is by definition `isclose(a, b).all()` (torch's own kernel
computes it that way), and both pieces shard: `isclose` is pointwise, and counting the elements that are not close
sums the shards' counts. Only that count crosses ranks; the inputs are never gathered.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Replicate
from dtensor_ext.torch_fixes import swap_handlers, torch_fix

aten = torch.ops.aten


def _allclose(op_call, args, kwargs):
    bound = op_call._schema.arguments
    values = {a.name: a.default_value for a in bound if a.has_default_value()}
    values.update(zip((a.name for a in bound), args))
    values.update(kwargs)
    close = torch.isclose(values["self"], values["other"], rtol=values["rtol"], atol=values["atol"],
                          equal_nan=values["equal_nan"])
    # a count of the elements not close: a sum shards on every torch (2.14 gathers a boolean all() instead)
    return int(close.logical_not().sum().full_tensor().item()) == 0


@functools.cache
def _torch_refuses_allclose() -> bool:
    """Feature check: torch's propagation of `allclose` of two replicated [2, 2] tensors on a 2-rank probe mesh
    finds no strategy."""
    x = _compat.probe_spec(torch.zeros(2, 2), (Replicate(),))
    return not _compat.propagates(aten.allclose.default, (x, x))


@torch_fix(
    "allclose has no strategy",
    ops=("aten::allclose.default",),
    why="torch.allclose of DTensors fails on every layout: the decomposition fallback cannot produce a bool from "
    "fake tensors",
)
def fix_allclose():
    op = aten.allclose.default
    if _compat.custom_op_handler(op) is not None or not _torch_refuses_allclose():
        return None  # this torch answers allclose itself (a handler of its own is never replaced)
    return swap_handlers({op: _allclose})
