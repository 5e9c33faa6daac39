"""Batched solves (`linalg.solve_triangular`, `linalg.lu_solve`, `linalg.ldl_solve`) sharded on a batch dim: each
operand is sharded where it has that dim, and kept whole only where it broadcasts.

torch's single-dim rules shard the output and every operand on the same dim index, and solve_triangular's also
offers "A replicated, B sharded on a batch dim" for any shapes. Both ignore broadcasting. With A and B of the
same batch, A whole against B's shard makes the local kernel broadcast A's full batch against B's piece (an
error, or on a 2x2 mesh an output whose shards hold the whole batch while claiming `Shard`: an invalid DTensor,
found by the thorough OpInfo run). Where B has fewer batch dims than the factorization (`ldl_solve` of LD
`[2, 5, 5]` with B `[5, 5]`), the shared index shards B's matrix rows instead. The fix keeps torch's rows without
a shard (the Partial rows: the solution is linear in B) and states the batch rows by broadcasting, as the
elementwise rows of the operands' batch dims (the factor-signature generator): for each batch dim of the output,
an operand that has the dim unbroadcast is sharded on it, one that lacks it or broadcasts it stays whole.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import ShardingPlaceholder
from dtensor_ext.rules.pointwise import elementwise_rows
from dtensor_ext.torch_fixes import applied_to, torch_fix
from dtensor_ext.torch_fixes.strategy_swap import wrap_single_dim_rules

aten = torch.ops.aten

# op -> the number of trailing (non-batch) dims of each tensor operand, in schema order; outputs have 2
CORE_DIMS = {
    aten.linalg_solve_triangular.default: (2, 2),  # A, B
    aten.linalg_lu_solve.default: (2, 1, 2),  # LU, pivots, B
    aten.linalg_ldl_solve.default: (2, 1, 2),  # LD, pivots, B
}


def batch_rows(operands: list[tuple[torch.Size, int]]) -> list[list]:
    """[out, *operands] given each operand's (shape, trailing non-batch dims): the elementwise rows of the batch
    dims alone (aligned from the right, a broadcast dim whole), which lead, so their indices are the operands' own."""
    return elementwise_rows([_compat.tensor_meta(torch.empty(shape[: len(shape) - core], device="meta"))
                             for shape, core in operands])


def _has_shard(row) -> bool:
    return any(isinstance(p, ShardingPlaceholder) for p in row)


def _broadcasting_batch_rows(torch_rule):
    def rule(op, args_meta, kwargs_meta):
        unsharded = [row for row in torch_rule(op, args_meta, kwargs_meta) if not _has_shard(row)]
        operands = [(meta.shape, core) for meta, core in zip(args_meta, CORE_DIMS[op])]
        return unsharded + batch_rows(operands)

    return rule


def _probe_operands(op) -> tuple:
    """A factorization with a batch of 2 and a B with none (it broadcasts), as tensor metas."""
    matrices, vectors, rhs = torch.zeros(2, 3, 3), torch.zeros(2, 3, dtype=torch.int32), torch.zeros(3, 1)
    tensors = (matrices, rhs) if CORE_DIMS[op] == (2, 2) else (matrices, vectors, rhs)
    return tuple(_compat.tensor_meta(t) for t in tensors)


@functools.cache
def _offers_rows_broadcasting_forbids(op) -> bool:
    """Feature check on torch's rule itself: on the probe operands, does it offer a batch row that broadcasting
    does not allow (a shard on a dim the operand lacks, or one operand whole against another's shard)?"""
    torch_rule = _compat.single_dim_func(op)
    if torch_rule is None:
        return False
    metas = _probe_operands(op)
    allowed = {str(row) for row in batch_rows([(m.shape, c) for m, c in zip(metas, CORE_DIMS[op])])}
    return any(_has_shard(row) and str(row) not in allowed for row in torch_rule(op, metas, {}))


@torch_fix(
    "batched solves broadcasting",
    ops=tuple(_compat.torch_op_names(op)[0] for op in CORE_DIMS),
    why="torch's rules shard every operand on one dim index: B's batch against a whole A of the same batch (the "
    "kernel broadcasts: an error, or an invalid DTensor on 2x2), or a B without batch dims on its matrix rows",
)
def fix_batched_solves():
    faulty = [op for op in CORE_DIMS
              if _compat.torch_strategy_kind(op) == "single_dim" and _offers_rows_broadcasting_forbids(op)]
    if not faulty:
        return None
    return applied_to(faulty, wrap_single_dim_rules(faulty, _broadcasting_batch_rows))
