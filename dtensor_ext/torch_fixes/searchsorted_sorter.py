"""`torch.searchsorted(seq, values, sorter=...)` (values a tensor or one number): the keyword `sorter` is moved
with the sequence.

`sorter` is keyword-only, and DTensor's dispatch redistributes positional tensors only: where the strategy moves
the sequence (rows sharded like the values, or gathered), the kernel still gets the sorter's unmoved pieces, and
pairs the sequence's rows with other rows' sort orders (WRONG results, found by the thorough OpInfo run on 2x2:
values sharded on two mesh dims, sorter sharded on one). The sorter permutes each row of the sequence, so it
belongs exactly where the sequence goes; the handler moves it there after DTensor's own propagation and
redistribution of the positional arguments. Calls without a DTensor sorter run DTensor's generic path.
"""

from __future__ import annotations

import functools

import torch
from dtensor_ext import _compat
from dtensor_ext._compat import Replicate, Shard
from dtensor_ext.torch_fixes import applied_to, dispatch_moving_keywords, swap_handlers, torch_fix

aten = torch.ops.aten


def _with_the_sequence(name, sorter, schema):
    return schema.args_schema[0].placements


def _searchsorted(op_call, args, kwargs):
    return dispatch_moving_keywords(op_call, args, kwargs, _with_the_sequence)


@functools.cache
def _sorter_left_behind() -> bool:
    """Feature check, run as rank 0 of a 2-rank probe mesh (every move is a local chunk): the sequence and values
    [2, 2] sharded on their rows, the sorter replicated. Where DTensor leaves the sorter whole, the kernel pairs one
    row of the sequence with two of the sorter and fails; no strategy at all means nothing to fix."""
    seq, values, sorter = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 2.0]]), torch.tensor([[0, 1], [1, 0]])
    with _compat.probing_dtensor_ops():
        args = [_compat.probe_dtensor(t, (Shard(0),), (2, 2)) for t in (seq, values)]
        whole_sorter = _compat.probe_dtensor(sorter, (Replicate(),), (2, 2))
        try:
            out = torch.searchsorted(*args, sorter=whole_sorter)
        except NotImplementedError:
            return False
        except RuntimeError:
            return True
    return not torch.equal(out.to_local(), torch.searchsorted(seq, values, sorter=sorter[:1]))


@torch_fix(
    "searchsorted keyword sorter",
    ops=("aten::searchsorted.Tensor", "aten::searchsorted.Scalar"),
    why="DTensor never moves keyword tensors: with the sequence moved, the kernel pairs its rows with the "
    "unmoved sorter's (WRONG results or an error)",
)
def fix_searchsorted_sorter():
    ops = [op for op in (aten.searchsorted.Tensor, aten.searchsorted.Scalar) if _compat.custom_op_handler(op) is None]
    if not ops or not _sorter_left_behind():
        return None
    return applied_to(ops, swap_handlers(dict.fromkeys(ops, _searchsorted)))
