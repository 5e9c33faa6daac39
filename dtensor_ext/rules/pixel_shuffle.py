"""pixel_shuffle / pixel_unshuffle: [*B, C*r*r, H, W] <-> [*B, C, H*r, W*r], and channel_shuffle: a fixed
permutation of elements.

torch 2.13 has no strategy for either and falls back to propagating through their decomposition (views and a
permute), which shards H or W: the fused kernel then runs on a piece whose height is no multiple of r and fails,
and a sharded batch dim is gathered although each batch element is shuffled on its own. Since the ops only move
elements, every Partial reduction passes through. Every dim shards where each rank's output chunk is made of
exactly its input chunk (pixel_shuffle: r times its rows and columns, its channels over r*r): the rules list every
dim and their `layouts` filter, which sees the mesh, keeps only the layouts where the chunks line up (always for
r == 1 and for batch dims; for an even split of C, H and W; and some uneven ones).

pixel_unshuffle's kernel returns an EMPTY input unchanged (`torch.pixel_unshuffle(torch.empty(0, 1, 6, 6), 3)`
has shape (0, 1, 6, 6), not (0, 9, 2, 2)), and uneven sharding can leave a rank an empty piece (5 rows on 4
ranks: 2, 2, 1, 0) whose local result would then have the wrong shape: for r > 1 its filter also drops those.

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


def _pieces_in_proportion(in_shape, out_shape, mesh_shape, placements) -> bool:
    """Whether every rank's piece is the same fraction of each dim in the input and in the output: chunks follow
    the rank order alike in both, so proportional shapes mean the output chunk is made of the input chunk."""
    ins = _compat.local_shapes(in_shape, mesh_shape, placements)
    outs = _compat.local_shapes(out_shape, mesh_shape, placements)
    return all(o[d] * in_shape[d] == i[d] * out_shape[d] for i, o in zip(ins, outs) for d in range(len(in_shape)))


def shuffled_chunks_align(in_shape, factor: int, mesh_shape, placements) -> bool:
    """Whether pixel_shuffle(x, factor) of `in_shape` [*B, C*r*r, H, W] placed as `placements` gives every rank
    the output chunk that the same placements give the output."""
    *batch, channels, height, width = in_shape
    out_shape = (*batch, channels // (factor * factor), height * factor, width * factor)
    return _pieces_in_proportion(tuple(in_shape), out_shape, mesh_shape, placements)


def unshuffled_chunks_align(in_shape, factor: int, mesh_shape, placements) -> bool:
    """The same for pixel_unshuffle(x, factor) of `in_shape` [*B, C, H*r, W*r]; for r > 1 also no rank may hold an
    empty piece of a non-empty input (the kernel returns it unchanged)."""
    *batch, channels, height, width = in_shape
    out_shape = (*batch, channels * factor * factor, height // factor, width // factor)
    if factor != 1 and 0 not in tuple(in_shape):
        if any(0 in tuple(local) for local in _compat.local_shapes(in_shape, mesh_shape, placements)):
            return False
    return _pieces_in_proportion(tuple(in_shape), out_shape, mesh_shape, placements)


def _layouts(chunks_align: Callable) -> Callable[[OpSchema], Callable[[OpSpec], bool]]:
    def layouts(op_schema: OpSchema) -> Callable[[OpSpec], bool]:
        factor = op_schema.args_schema[1]

        def keeps(spec: OpSpec) -> bool:
            source = spec.input_specs[0]
            return chunks_align(source.tensor_meta.shape, factor, source.mesh.shape, source.placements)

        return keeps

    return layouts


def _every_dim_rows(self) -> list[list]:
    return [[ShardingPlaceholder(d), ShardingPlaceholder(d)] for d in range(len(self.shape))] + _partial_rows()


@single_dim_rule("aten::pixel_shuffle.default", family=FAMILY, schema_info=RuntimeSchemaInfo(1),
                 layouts=_layouts(shuffled_chunks_align))
def pixel_shuffle_rule(op, args, kwargs):
    """(self [*B, C*r*r, H, W], r): shard any dim (C, H and W where the chunks line up: `layouts`), or keep a
    Partial input Partial."""
    return _every_dim_rows(args[0])


@single_dim_rule("aten::pixel_unshuffle.default", family=FAMILY, schema_info=RuntimeSchemaInfo(1),
                 layouts=_layouts(unshuffled_chunks_align))
def pixel_unshuffle_rule(op, args, kwargs):
    """(self [*B, C, H*r, W*r], r): shard any dim where the chunks line up and no rank's piece is empty
    (`layouts`), or keep a Partial input Partial."""
    return _every_dim_rows(args[0])


@single_dim_rule(["aten::channel_shuffle.default", "aten::native_channel_shuffle.default"], family=FAMILY,
                 schema_info=RuntimeSchemaInfo(1))
def channel_shuffle_rule(op, args, kwargs):
    """(self [N, C, *spatial], groups): shard any dim but the channels (dim 1), or keep a Partial input Partial."""
    ndim = len(args[0].shape)
    return [[ShardingPlaceholder(d), ShardingPlaceholder(d)] for d in range(ndim) if d != 1] + _partial_rows()
