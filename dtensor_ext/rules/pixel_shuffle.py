"""pixel_shuffle / pixel_unshuffle: [*B, C*r*r, H, W] <-> [*B, C, H*r, W*r], and channel_shuffle: a fixed
permutation of elements.

torch 2.13 has no strategy for either and falls back to propagating through their decomposition (views and a
permute), which shards H or W: the fused kernel then runs on a piece whose height is no multiple of r and fails,
and a sharded batch dim is gathered although each batch element is shuffled on its own. Since the ops only move
elements, every Partial reduction passes through. pixel_shuffle's C, H and W shard too where every rank's output
chunk is made of exactly its input chunk (r times its rows and columns, its channels over r*r): the rule lists
them and its `layouts` filter, which sees the mesh, keeps only the layouts where the chunks line up (always for
r == 1; for an even split of C, H and W; and some uneven ones). pixel_unshuffle keeps C, H and W whole.

Batch dims shard for pixel_shuffle only: torch's pixel_unshuffle kernel returns an EMPTY input unchanged
(`torch.pixel_unshuffle(torch.empty(0, 1, 6, 6), 3)` has shape (0, 1, 6, 6), not (0, 9, 2, 2)), and uneven
sharding leaves some rank an empty shard (5 rows on 4 ranks: 2, 2, 1, 0) whose local result would then have
the wrong shape.

channel_shuffle ([N, C, *spatial], groups) reorders channels within each (sample, position): every dim but C
shards, evenly or not (its kernel keeps empty inputs' shapes), and Partial passes as above.
"""

from __future__ import annotations

from collections.abc import Callable

from dtensor_ext import _compat
from dtensor_ext._compat import OpSchema, OpSpec, Partial, RuntimeSchemaInfo, ShardingPlaceholder
from dtensor_ext.registry import single_dim_rule
from dtensor_ext.rules.copy_ops import DATA_MOVEMENT_REDUCTIONS

FAMILY = "views"


def _partial_rows() -> list[list]:
    return [[Partial(r), Partial(r)] for r in DATA_MOVEMENT_REDUCTIONS]


def shuffled_chunks_align(in_shape, factor: int, mesh_shape, placements) -> bool:
    """Whether pixel_shuffle(x, factor) of `in_shape` placed as `placements` gives every rank the output chunk that
    the same placements give the output: its local output has r times its rows and columns and 1/(r*r) of its
    channels, and chunks follow the rank order alike in both, so equal shapes mean equal offsets."""
    *batch, channels, height, width = in_shape
    out_shape = (*batch, channels // (factor * factor), height * factor, width * factor)
    scale = (*[(1, 1)] * len(batch), (1, factor * factor), (factor, 1), (factor, 1))  # out * a == in * b
    ins = _compat.local_shapes(in_shape, mesh_shape, placements)
    outs = _compat.local_shapes(out_shape, mesh_shape, placements)
    return all(o[d] * a == i[d] * b for i, o in zip(ins, outs) for d, (b, a) in enumerate(scale))


def _shuffled_chunks_align(op_schema: OpSchema) -> Callable[[OpSpec], bool]:
    factor = op_schema.args_schema[1]

    def keeps(spec: OpSpec) -> bool:
        source = spec.input_specs[0]
        return shuffled_chunks_align(source.tensor_meta.shape, factor, source.mesh.shape, source.placements)

    return keeps


@single_dim_rule("aten::pixel_shuffle.default", family=FAMILY, schema_info=RuntimeSchemaInfo(1),
                 layouts=_shuffled_chunks_align)
def pixel_shuffle_rule(op, args, kwargs):
    """(self [*B, C*r*r, H, W], r): shard any dim (C, H and W where the chunks line up: `layouts`), or keep a
    Partial input Partial."""
    return [[ShardingPlaceholder(d), ShardingPlaceholder(d)] for d in range(len(args[0].shape))] + _partial_rows()


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
