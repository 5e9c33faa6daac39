"""The backward of `index_put` (`y = x.index_put(idx, v)`, `y = x.clone(); y[idx] = v` in a model) on a DTensor.

`self`'s gradient is the output gradient with the written positions zeroed: autograd's formula calls
`grad.index_put(indices, zeros, accumulate)` with `zeros` a plain tensor of the values' global shape, built from
the gradient's options, next to a DTensor gradient, which DTensor refuses ("got mixed torch.Tensor and DTensor") on
every torch checked (2.11 to 2.15), whatever the placements, replicated included. Here an `index_put` whose
`values` is a plain tensor while `self` is a DTensor takes those values as replicated on `self`'s mesh, as they are:
SPMD code (the autograd formula included) builds them alike on every rank, as `list_indices` takes a plain index
tensor (`torch_fixes.plain_operand_replicated`). Every other `index_put` goes through DTensor's own path.
Decided by a probe: whether the backward of `index_put` of a replicated probe DTensor fails.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Replicate
from dtensor_ext.torch_fixes import plain_operand_replicated, swap_handlers, torch_fix

aten = torch.ops.aten


@functools.cache
def _index_put_backward_fails() -> bool:
    """Feature check: the backward of `x.index_put((i,), v).sum()` for a replicated (4, 2) DTensor `x`, a replicated
    index and values, on a 2-rank probe mesh, run as rank 0 (nothing needs moving), raises (grad mode on)."""
    with _compat.probing_dtensor_ops(), torch.enable_grad():
        x = _compat.probe_dtensor(torch.zeros(4, 2), (Replicate(),), (4, 2)).requires_grad_()
        index = _compat.probe_dtensor(torch.tensor([1, 3]), (Replicate(),), (2,))
        values = _compat.probe_dtensor(torch.zeros(2, 2), (Replicate(),), (2, 2))
        try:
            x.index_put((index,), values).sum().backward()
        except RuntimeError:
            return True
    return False


@torch_fix(
    "index_put backward writes plain zeros",
    ops=("aten::index_put",),
    why="the backward of index_put (x[idx] = v on a tensor that needs a gradient) zeroes the written positions of "
    "the DTensor gradient with plain zeros, which DTensor refuses",
)
def fix_index_put_backward():
    op = aten.index_put.default
    if _compat.custom_op_handler(op) is not None or not _index_put_backward_fails():
        return None  # this torch builds the zeros as a DTensor (a handler of its own is never replaced)
    return swap_handlers({op: plain_operand_replicated(plain_at=2, like_at=0)})  # index_put(self, indices, values)
