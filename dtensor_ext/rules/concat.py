"""Concatenation-like ops: gluing whole tensors (or their chunks) together along one dim.

They only move data, so every operand may carry the same Partial (of any kind): the reduction commutes with
the copy. A dim other than the glued one may be sharded when every operand has it at the same size, since the
shards then line up piece by piece.
"""

from __future__ import annotations

from dtensor_ext._compat import Partial, Replicate, RuntimeSchemaInfo, ShardingPlaceholder
from dtensor_ext.registry import single_dim_rule

FAMILY = "concat"

# Data movement commutes with every reduction a Partial can stand for.
MOVED_REDUCTIONS = ("sum", "avg", "max", "min")


def _same_partial_rows(width: int) -> list[list]:
    return [[Partial(r)] * width for r in MOVED_REDUCTIONS]


def _is_legacy_empty(meta) -> bool:
    """cat skips 1-D tensors of size 0 whatever the rank of the others (legacy behaviour)."""
    return tuple(meta.shape) == (0,)


@single_dim_rule(
    "aten::cat", family=FAMILY, schema_info=RuntimeSchemaInfo(1, needs_pytree=True), superset_of_torch=True
)
def cat_rule(op, args, kwargs):
    """cat(tensors, dim): shard any other dim in every operand (a skipped empty operand stays replicated)."""
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    joined = [t for t in tensors if not _is_legacy_empty(t)]
    if not joined:
        return _same_partial_rows(1 + len(tensors))
    ndim = len(joined[0].shape)
    dim %= ndim
    rows = []
    for d in range(ndim):
        if d == dim:
            continue
        operands = [Replicate() if _is_legacy_empty(t) else ShardingPlaceholder(d) for t in tensors]
        rows.append([ShardingPlaceholder(d), *operands])
    return rows + _same_partial_rows(1 + len(tensors))


@single_dim_rule(
    "aten::stack", family=FAMILY, schema_info=RuntimeSchemaInfo(1, needs_pytree=True), superset_of_torch=True
)
def stack_rule(op, args, kwargs):
    """stack(tensors, dim): a new dim is inserted at `dim`; input dim d is output dim d, or d+1 from `dim` on."""
    tensors = args[0]
    ndim = len(tensors[0].shape)
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % (ndim + 1)
    rows = [
        [ShardingPlaceholder(d if d < dim else d + 1), *([ShardingPlaceholder(d)] * len(tensors))]
        for d in range(ndim)
    ]
    return rows + _same_partial_rows(1 + len(tensors))


@single_dim_rule("aten::_chunk_cat", family=FAMILY, schema_info=RuntimeSchemaInfo(1, needs_pytree=True))
def chunk_cat_rule(op, args, kwargs):
    """_chunk_cat(tensors, dim, num_chunks): each operand becomes [*lead, num_chunks, -1] (zero padded), then cat.

    The zero padding is the same on every rank, so Partials of any kind survive it. The dims before `dim` would
    pass through unchanged, but _chunk_cat refuses empty operands and DTensor's chunking leaves some ranks empty
    even where a dim is longer than the mesh (9 rows on 4 ranks: 3, 3, 3, 0), so no dim is sharded.
    """
    return _same_partial_rows(1 + len(args[0]))


@single_dim_rule("aten::block_diag", family=FAMILY, schema_info=RuntimeSchemaInfo(1, needs_pytree=True))
def block_diag_rule(op, args, kwargs):
    """Blocks on the diagonal, zeros elsewhere: only Partials pass (a block's offset depends on all the others)."""
    return _same_partial_rows(1 + len(args[0]))


@single_dim_rule("aten::unfold", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def unfold_rule(op, args, kwargs):
    """Tensor.unfold(dimension, size, step): windows along `dimension`, window contents as a new last dim."""
    self, dimension = args[0], args[1]
    ndim = len(self.shape)
    if ndim == 0:
        return _same_partial_rows(2)
    dimension %= ndim
    rows = [[ShardingPlaceholder(d), ShardingPlaceholder(d)] for d in range(ndim) if d != dimension]
    return rows + _same_partial_rows(2)


# im2col pads with zeros, which commutes with a sum or mean but not with a max or min.
_ZERO_PADDED_REDUCTIONS = ("sum", "avg")


@single_dim_rule(["aten::im2col", "aten::col2im"], family=FAMILY, schema_info=RuntimeSchemaInfo(1),
                 allow_uneven_sharding=False)
def im2col_rule(op, args, kwargs):
    """F.unfold / F.fold: [N, C, H, W] <-> [N, C * kh * kw, L] (batch dim optional). Both copy (col2im also adds
    overlapping windows) within one sample and one channel, so the batch dim and the channel dim shard; channel c
    owns the block [c * kh * kw, (c + 1) * kh * kw) of the column dim, so a channel shard is a column shard when
    the shards are even (hence even shards only)."""
    batched = len(args[0].shape) == (4 if op.name() == "aten::im2col" else 3)
    rows = [[ShardingPlaceholder(0), ShardingPlaceholder(0)]] if batched else []
    channel = 1 if batched else 0
    rows.append([ShardingPlaceholder(channel), ShardingPlaceholder(channel)])
    return rows + [[Partial(r), Partial(r)] for r in _ZERO_PADDED_REDUCTIONS]
