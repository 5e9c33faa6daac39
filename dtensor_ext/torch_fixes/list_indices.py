"""Indexing a DTensor with a Python list of ints or a plain tensor (`x[[1, 2]]`, `x[idx]`, `x[perm] = arange(n)`).

torch turns a list into an index tensor in C++ (`Tensor.__getitem__` / `__setitem__`) and passes it to
`aten.index` / `aten.index_put_` next to the DTensor; DTensor refuses any plain tensor of more than one element
("got mixed torch.Tensor and DTensor"), so a list of one int works and a list of two fails. The list is Python
data every rank holds, like an int or a slice index, so the fix turns it into a replicated DTensor index before
torch does. A plain tensor in an indexing expression is taken the same way: SPMD code computes it alike on every
rank, as it does an int or a slice (Hugging Face's MoE routing writes `inv_perm[perm] = torch.arange(n)` into a
DTensor); a plain tensor next to a DTensor in any other op is still refused.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dtensor_ext import _compat
from dtensor_ext._compat import Replicate
from dtensor_ext.torch_fixes import replicated_like, torch_fix


def _is_index_list(part: Any) -> bool:
    """A flat list of ints: torch makes it an index tensor, never a tuple of indices. (A list of bools is a mask,
    whose selection has a data-dependent shape: left alone.)"""
    return type(part) is list and bool(part) and all(type(i) is int for i in part)


def _is_plain_tensor(part: Any) -> bool:
    return isinstance(part, torch.Tensor) and not isinstance(part, DTensor)


def _replicated_if_rank_data(like: DTensor, part: Any) -> Any:
    return replicated_like(like, part) if _is_index_list(part) or _is_plain_tensor(part) else part


def _with_replicated_lists(self: DTensor, index: Any) -> Any:
    if isinstance(index, tuple):
        return tuple(_replicated_if_rank_data(self, p) for p in index)
    return _replicated_if_rank_data(self, index)


@functools.cache
def _refuses_list_index() -> bool:
    """Feature check: `x[[0, 1]]` of a replicated [2, 3] DTensor on a 2-rank probe mesh, run as rank 0, raises
    (nothing needs moving, so only the plain index tensor next to the DTensor can make it fail)."""
    with _compat.probing_dtensor_ops():
        x = _compat.probe_dtensor(torch.zeros(2, 3), (Replicate(),), (2, 3))
        try:
            x[[0, 1]]
        except RuntimeError:
            return True
    return False


@torch_fix(
    "DTensor indexing with a Python list or a plain tensor",
    ops=("aten::index.Tensor", "aten::index_put_.default"),
    why="x[[1, 2]], x[plain_index] and x[i] = plain_value on a DTensor fail: DTensor refuses the plain tensor torch "
    "passes next to it",
)
def fix_list_indices():
    if not _refuses_list_index():
        return None  # this torch indexes DTensors with lists itself
    own = {name: vars(DTensor).get(name) for name in ("__getitem__", "__setitem__")}  # torch's, where it has them
    torch_getitem = own["__getitem__"] or torch.Tensor.__getitem__
    torch_setitem = own["__setitem__"] or torch.Tensor.__setitem__

    # the index's conversion is the fix's own work, not the user's ops: a TorchFunctionMode (the policy executor)
    # sees only the indexing itself
    def getitem(self, index):
        with _compat.outside_torch_function_modes():
            index = _with_replicated_lists(self, index)
        return torch_getitem(self, index)

    def setitem(self, index, value):
        with _compat.outside_torch_function_modes():
            value, index = _replicated_if_rank_data(self, value), _with_replicated_lists(self, index)
        return torch_setitem(self, index, value)

    DTensor.__getitem__, DTensor.__setitem__ = getitem, setitem

    def undo():
        for name, method in own.items():
            if method is None:
                delattr(DTensor, name)
            else:
                setattr(DTensor, name, method)

    return undo
