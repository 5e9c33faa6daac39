"""`nll_loss` with a mean over a sharded batch: torch averages the shards' means, which is wrong or refused.

torch's `nll_loss_forward_strategy` (`torch/distributed/tensor/_ops/_math_ops.py`) keeps the batch sharded for
`reduction="mean"` and declares the output `Partial(avg)`. A shard's mean divides by that shard's total weight
(the summed class weights of its non-ignored targets), so averaging the shards' means is the global mean only when
every shard has the same total weight: with class weights or an `ignore_index` target it is a WRONG result even on
even shards, and on uneven shards torch raises instead of choosing another layout (`cross_entropy` of a batch of
2 on 4 ranks). The replacement rule keeps torch's layouts where they are right (an unreduced loss stays sharded
like the batch; a summed one is `Partial(sum)`, total weight too) and for a mean asks for the batch whole, or
takes a `Partial` input (the loss is linear in its input for a fixed target).
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Partial, Replicate, ShardingPlaceholder, TensorMeta
from dtensor_ext.torch_fixes import replace_rule, torch_fix

aten = torch.ops.aten

NONE, MEAN = 0, 1  # torch's Reduction enum; 2 is sum


def nll_loss_forward_rule(op, args_meta, kwargs_meta):
    """(self [N, C, *d] or [C], target [N, *d] or [], weight [C] or None, reduction, ignore_index) ->
    (loss, total_weight). A sample's loss reads its whole row of class scores: only the batch and spatial dims
    shard, and only where the reduction is none (sharded loss) or sum (partial sums)."""
    self, target, weight, reduction = args_meta[:4]
    class_weight = [Replicate()] if isinstance(weight, TensorMeta) else []
    # linear in self; total_weight comes from the replicated target alone, so every rank has it whole
    rows = [[Partial(r), Replicate(), Partial(r), Replicate(), *class_weight] for r in ("sum", "avg")]
    if reduction == MEAN:
        return rows
    if class_weight:  # unreduced or summed, loss and total weight are linear in the class weights too
        rows += [[Partial(r), Partial(r), Replicate(), Replicate(), Partial(r)] for r in ("sum", "avg")]
    if len(self.shape) < 2:
        return rows
    for dim in (d for d in range(len(self.shape)) if d != 1):  # dim 1 holds the classes
        target_dim = dim if dim == 0 else dim - 1
        if reduction == NONE:  # total_weight is 0 on every rank
            loss, total_weight = ShardingPlaceholder(target_dim), Replicate()
        else:
            loss, total_weight = Partial("sum"), Partial("sum")
        rows.append([loss, total_weight, ShardingPlaceholder(dim), ShardingPlaceholder(target_dim), *class_weight])
    return rows


_AVERAGING_STRATEGY = "nll_loss_forward_strategy"  # torch 2.13's op_strategy, Partial(avg) for a mean


@torch_fix(
    "nll_loss mean of a sharded batch",
    ops=("aten::nll_loss_forward.default", "aten::nll_loss2d_forward.default"),
    why="a mean over a sharded batch is declared Partial(avg) of the shards' means: wrong with class weights or "
    "ignored targets, and refused on uneven shards",
)
def fix_nll_loss_mean():
    ops = [aten.nll_loss_forward.default, aten.nll_loss2d_forward.default]
    faulty = [op for op in ops if _compat.strategy_function_name(op) == _AVERAGING_STRATEGY]
    if not faulty:
        return None
    undos = [replace_rule(op, nll_loss_forward_rule, schema_info=_compat.RuntimeSchemaInfo(3)) for op in faulty]

    def undo():
        for undo_one in reversed(undos):
            undo_one()

    return undo
