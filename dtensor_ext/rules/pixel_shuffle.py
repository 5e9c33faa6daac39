"""pixel_shuffle / pixel_unshuffle: [*B, C*r*r, H, W] <-> [*B, C, H*r, W*r], and channel_shuffle: a fixed
permutation of elements.

torch 2.13 has no strategy for either and falls back to propagating through their decomposition (views and a
permute), which shards H or W: the fused kernel then runs on a piece whose height is no multiple of r and fails,
and a sharded batch dim is gathered although each batch element is shuffled on its own. Since the ops only move
elements, every Partial reduction passes through. C, H and W stay whole: their output chunks line up with the
input chunks only when the mesh divides C (or H/r, W/r) evenly, which a rule cannot see.

Batch dims shard for pixel_shuffle only: torch's pixel_unshuffle kernel returns an EMPTY input unchanged
(`torch.pixel_unshuffle(torch.empty(0, 1, 6, 6), 3)` has shape (0, 1, 6, 6), not (0, 9, 2, 2)), and uneven
sharding leaves some rank an empty shard (5 rows on 4 ranks: 2, 2, 1, 0) whose local result would then have
the wrong shape.

channel_shuffle ([N, C, *spatial], groups) reorders channels within each (sample, position): every dim but C
shards, evenly or not (its kernel keeps empty inputs' shapes), and Partial passes as above.
"""

from __future__ import annotations

from dtensor_ext._compat import Partial, RuntimeSchemaInfo, ShardingPlaceholder
from dtensor_ext.registry import single_dim_rule
from dtensor_ext.rules.copy_ops import DATA_MOVEMENT_REDUCTIONS

FAMILY = "views"


def _partial_rows() -> list[list]:
    return [[Partial(r), Partial(r)] for r in DATA_MOVEMENT_REDUCTIONS]


@single_dim_rule("aten::pixel_shuffle.default", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def pixel_shuffle_rule(op, args, kwargs):
    """(self [*B, C*r*r, H, W], r): shard a batch dim of *B, or keep a Partial input Partial."""
    batch_dims = len(args[0].shape) - 3
    return [[ShardingPlaceholder(d), ShardingPlaceholder(d)] for d in range(batch_dims)] + _partial_rows()


@single_dim_rule("aten::pixel_unshuffle.default", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def pixel_unshuffle_rule(op, args, kwargs):
    """(self [*B, C, H*r, W*r], r): keep a Partial input Partial (no shard: see the module doc)."""
    return _partial_rows()


@single_dim_rule(["aten::channel_shuffle.default", "aten::native_channel_shuffle.default"], family=FAMILY,
                 schema_info=RuntimeSchemaInfo(1))
def channel_shuffle_rule(op, args, kwargs):
    """(self [N, C, *spatial], groups): shard any dim but the channels (dim 1), or keep a Partial input Partial."""
    ndim = len(args[0].shape)
    return [[ShardingPlaceholder(d), ShardingPlaceholder(d)] for d in range(ndim) if d != 1] + _partial_rows()
