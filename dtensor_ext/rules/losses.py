"""Elementwise losses: mse, smooth-l1, huber, soft-margin, forward and backward.

torch 2.13 reaches these only through its decomposition fallback, which gets them wrong on sharded inputs: the
mean of per-rank means is not the mean when shards are uneven, and the backward divides by the LOCAL element count
(gradients `world` times too large even on even shards). The rules below claim only what holds for any shard sizes:

* reduction none: elementwise, so every operand sharded alike;
* reduction sum: each rank's sum is a Partial(sum) of the total;
* reduction mean: nothing sharded (the divisor is the global count, which no rank sees);
* backward: linear in grad_output, so a Partial grad_output with the operands replicated gives a Partial grad;
  with reduction none/sum the operands may be sharded alike.
"""

from __future__ import annotations

from dtensor_ext._compat import Partial, Replicate, RuntimeSchemaInfo, ShardingPlaceholder
from dtensor_ext.registry import single_dim_rule

FAMILY = "losses"
NONE, MEAN, SUM = 0, 1, 2  # at::Reduction


def _same_shape(*metas) -> bool:
    return len({tuple(m.shape) for m in metas}) == 1


@single_dim_rule(
    ["aten::mse_loss", "aten::smooth_l1_loss", "aten::huber_loss", "aten::soft_margin_loss"],
    family=FAMILY,
    schema_info=RuntimeSchemaInfo(2),
)
def loss_rule(op, args, kwargs):
    inp, target = args[:2]
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", MEAN)
    if not _same_shape(inp, target) or reduction == MEAN:
        return []
    out = {NONE: ShardingPlaceholder, SUM: lambda d: Partial("sum")}[reduction]
    return [[out(d), ShardingPlaceholder(d), ShardingPlaceholder(d)] for d in range(len(inp.shape))]


@single_dim_rule(
    [
        "aten::mse_loss_backward",
        "aten::smooth_l1_loss_backward",
        "aten::huber_loss_backward",
        "aten::soft_margin_loss_backward",
    ],
    family=FAMILY,
    schema_info=RuntimeSchemaInfo(3),
)
def loss_backward_rule(op, args, kwargs):
    grad_out, inp, target = args[:3]
    reduction = args[3] if len(args) > 3 else kwargs["reduction"]
    rows = [[Partial(r), Partial(r), Replicate(), Replicate()] for r in ("sum", "avg")]
    if not _same_shape(inp, target) or reduction == MEAN:
        return rows
    for d in range(len(inp.shape)):
        grad_placement = ShardingPlaceholder(d) if reduction == NONE else Replicate()
        rows.append([ShardingPlaceholder(d), grad_placement, ShardingPlaceholder(d), ShardingPlaceholder(d)])
    return rows
