"""`linalg.solve_triangular(A, B)` sharded on a batch dim: each operand is sharded where it has that dim, and kept
whole only where it broadcasts.

torch's single-dim rule shards out, A and B on the same dim index, and also offers "A replicated, B sharded on a
batch dim" for any shapes. Both ignore broadcasting: with A and B of the same batch, A whole against B's shard
makes the local kernel broadcast A's full batch against B's piece (an error, or on a 2x2 mesh an output whose
shards have the whole batch while claiming `Shard`: an invalid DTensor, found by the thorough OpInfo run); with
A having more batch dims than B, the same index names different dims. The fix keeps torch's rows without a
shard (the Partial rows, B being linear) and states the batch rows by broadcasting: for each batch dim of the
output, an operand that has the dim with more than one entry is sharded on it, one that lacks it or has size 1
stays whole.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Replicate, ShardingPlaceholder
from dtensor_ext.torch_fixes import torch_fix
from dtensor_ext.torch_fixes.strategy_swap import wrap_single_dim_rules

aten = torch.ops.aten


def batch_rows(a_shape: torch.Size, b_shape: torch.Size) -> list[list]:
    """[out, A, B] for each batch dim of the output that some operand really has (size above 1)."""
    out_ndim = max(len(a_shape), len(b_shape))
    rows = []
    for out_dim in range(out_ndim - 2):
        row = [ShardingPlaceholder(out_dim)]
        for shape in (a_shape, b_shape):
            own_dim = out_dim - (out_ndim - len(shape))
            row.append(ShardingPlaceholder(own_dim) if own_dim >= 0 and shape[own_dim] != 1 else Replicate())
        if any(not isinstance(p, Replicate) for p in row[1:]):
            rows.append(row)
    return rows


def _broadcasting_batch_rows(torch_rule):
    def rule(op, args_meta, kwargs_meta):
        unsharded = [row for row in torch_rule(op, args_meta, kwargs_meta)
                     if not any(isinstance(p, ShardingPlaceholder) for p in row)]
        return unsharded + batch_rows(args_meta[0].shape, args_meta[1].shape)

    return rule


@functools.cache
def _shards_b_against_whole_a() -> bool:
    """Feature check on torch's rule itself: for A and B with the same batch of 2, does it offer B sharded on the
    batch with A whole (which the kernel broadcasts)?"""
    op = aten.linalg_solve_triangular.default
    torch_rule = _compat.single_dim_func(op)
    if torch_rule is None:
        return False
    a, b = _compat.tensor_meta(torch.zeros(2, 3, 3)), _compat.tensor_meta(torch.zeros(2, 3, 1))
    rows = torch_rule(op, (a, b), {"upper": True})
    return any(isinstance(row[2], ShardingPlaceholder) and isinstance(row[1], Replicate) for row in rows)


@torch_fix(
    "solve_triangular batch broadcasting",
    ops=("aten::linalg_solve_triangular.default",),
    why="torch's rule shards B's batch against a whole A of the same batch (the kernel broadcasts: an error, or an "
    "invalid DTensor on 2x2) and names A's and B's batch dims by one index when their ranks differ",
)
def fix_solve_triangular_batch():
    op = aten.linalg_solve_triangular.default
    if _compat.torch_strategy_kind(op) != "single_dim" or not _shards_b_against_whole_a():
        return None
    return wrap_single_dim_rules([op], _broadcasting_batch_rows)
