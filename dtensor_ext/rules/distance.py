"""Pairwise distances (torch.cdist; F.pdist below): x1 [*B, P, M] and x2 [*B, R, M] give [*B, P, R].

A distance is a p-norm over the feature dim M, which is not linear: in general the distances of M's shards do
not combine into the distance, so M shards forward only for p in {0, 1, inf}, where the distance is a sum or max
of per-feature terms. Each (batch, row of x1, row of x2) cell depends on its own two rows only, so the batch dims
and the row dims P and R shard freely.
"""

from __future__ import annotations

from dtensor_ext._compat import Partial, Replicate, RuntimeSchemaInfo, ShardingPlaceholder
from dtensor_ext.registry import single_dim_rule

FAMILY = "distance"

# The p-norms that are a plain reduction of per-feature terms, so a feature shard's distance is a piece of it:
# p=0 counts differing features, p=1 sums |x1 - x2|, p=inf takes their max.
_FEATURE_REDUCTION = {0.0: "sum", 1.0: "sum", float("inf"): "max"}


def _batch_rows(out_batch: int, operands) -> list[list]:
    """A batch dim of the broadcast output: sharded where an operand holds it at full size, replicated where the
    operand broadcasts it (size 1 or missing). `operands` are (meta, output batch sizes) pairs."""
    rows = []
    for d in range(len(out_batch)):
        row = [ShardingPlaceholder(d)]
        for meta in operands:
            offset = len(out_batch) - (len(meta.shape) - 2)
            own = d - offset
            held = own >= 0 and meta.shape[own] == out_batch[d]
            row.append(ShardingPlaceholder(own) if held else Replicate())
        rows.append(row)
    return rows


def _out_batch(x1, x2) -> list[int]:
    b1, b2 = list(x1.shape[:-2]), list(x2.shape[:-2])
    width = max(len(b1), len(b2))
    b1, b2 = [1] * (width - len(b1)) + b1, [1] * (width - len(b2)) + b2
    return [max(a, b) for a, b in zip(b1, b2)]


@single_dim_rule("aten::_cdist_forward", family=FAMILY, schema_info=RuntimeSchemaInfo(2))
def cdist_rule(op, args, kwargs):
    """(x1, x2, p, compute_mode) -> [*B, P, R]: shard a batch dim, P (x1's rows) or R (x2's rows)."""
    x1, x2 = args[0], args[1]
    out_batch = _out_batch(x1, x2)
    b, n1, n2 = len(out_batch), len(x1.shape), len(x2.shape)
    rows = _batch_rows(out_batch, [x1, x2])
    rows.append([ShardingPlaceholder(b), ShardingPlaceholder(n1 - 2), Replicate()])
    rows.append([ShardingPlaceholder(b + 1), Replicate(), ShardingPlaceholder(n2 - 2)])
    reduction = _FEATURE_REDUCTION.get(float(args[2]))
    if reduction is not None:
        rows.append([Partial(reduction), ShardingPlaceholder(n1 - 1), ShardingPlaceholder(n2 - 1)])
    return rows


@single_dim_rule("aten::_cdist_backward", family=FAMILY, schema_info=RuntimeSchemaInfo(3))
def cdist_backward_rule(op, args, kwargs):
    """(grad, x1, x2, p, cdist) -> grad_x1 [*B, P, M], a sum over x2's rows R of terms that, given the distance,
    are elementwise in M. So: batch and P shard everywhere they appear; R makes per-shard sums (Partial(sum));
    M shards x1 and x2 with grad and cdist whole; and the result is linear in grad."""
    grad, x1, x2, dist = args[0], args[1], args[2], args[4]
    linear_rows = [[Partial(r), Partial(r), Replicate(), Replicate(), Replicate()] for r in ("sum", "avg")]
    if tuple(x1.shape[:-2]) != tuple(grad.shape[:-2]):
        return linear_rows  # an empty shard (or p=0) returns zeros shaped like the unbroadcast x1, not grad_x1
    rows = _batch_rows(list(grad.shape[:-2]), [grad, x1, x2, dist])
    out_p, out_m = len(grad.shape) - 2, len(grad.shape) - 1
    p1, m1, r2, m2 = len(x1.shape) - 2, len(x1.shape) - 1, len(x2.shape) - 2, len(x2.shape) - 1
    rows.append([ShardingPlaceholder(out_p), ShardingPlaceholder(out_p), ShardingPlaceholder(p1), Replicate(),
                 ShardingPlaceholder(out_p)])
    rows.append([Partial("sum"), ShardingPlaceholder(out_m), Replicate(), ShardingPlaceholder(r2),
                 ShardingPlaceholder(out_m)])
    rows.append([ShardingPlaceholder(out_m), Replicate(), ShardingPlaceholder(m1), ShardingPlaceholder(m2),
                 Replicate()])
    return rows + linear_rows


@single_dim_rule("aten::_pdist_forward", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def pdist_rule(op, args, kwargs):
    """(self [N, M], p) -> the N * (N - 1) / 2 distances between rows: every output mixes two rows, so only the
    feature dim shards, and only for the p-norms that reduce per-feature terms."""
    p = args[1] if len(args) > 1 else kwargs.get("p", 2.0)
    reduction = _FEATURE_REDUCTION.get(float(p))
    return [] if reduction is None else [[Partial(reduction), ShardingPlaceholder(1)]]


@single_dim_rule("aten::_pdist_backward", family=FAMILY, schema_info=RuntimeSchemaInfo(2))
def pdist_backward_rule(op, args, kwargs):
    """(grad, self, p, pdist) -> grad_self [N, M]: given the distances, elementwise in M (grad and pdist whole);
    linear in grad."""
    rows = [[ShardingPlaceholder(1), Replicate(), ShardingPlaceholder(1), Replicate()]]
    return rows + [[Partial(r), Partial(r), Replicate(), Replicate()] for r in ("sum", "avg")]
