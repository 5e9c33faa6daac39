"""pixel_shuffle / pixel_unshuffle: [*B, C*r*r, H, W] <-> [*B, C, H*r, W*r], a fixed permutation of elements.

torch 2.13 has no strategy for either and falls back to propagating through their decomposition (views and a
permute), which shards H or W: the fused kernel then runs on a piece whose height is no multiple of r and fails,
and a sharded batch dim is gathered although each batch element is shuffled on its own. Here every leading batch
dim shards freely, and since the op only moves elements, every Partial reduction passes through. C, H and W stay
whole: their output chunks line up with the input chunks only when the mesh divides C (or H/r, W/r) evenly,
which a rule cannot see. The kernels return an EMPTY input unchanged (wrong shape: torch.pixel_unshuffle(
torch.empty(0, 1, 6, 6), 3) has shape (0, 1, 6, 6)), so no rank may hold an empty shard: the rule is registered
without uneven sharding, which makes DTensor keep a dim sharded only where every rank gets part of it.
"""

from __future__ import annotations

from dtensor_ext._compat import Partial, RuntimeSchemaInfo, ShardingPlaceholder
from dtensor_ext.registry import single_dim_rule

FAMILY = "views"

_PERMUTATION_SAFE_REDUCTIONS = ("sum", "avg", "max", "min")


@single_dim_rule(
    ("aten::pixel_shuffle.default", "aten::pixel_unshuffle.default"),
    family=FAMILY,
    schema_info=RuntimeSchemaInfo(1),
    allow_uneven_sharding=False,  # no empty shards: on an empty input the kernels return the input's shape
)
def pixel_shuffle_rule(op, args, kwargs):
    """(self [*B, C, H, W], factor): shard a batch dim of *B, or keep a Partial input Partial."""
    batch_dims = len(args[0].shape) - 3
    rows = [[ShardingPlaceholder(d), ShardingPlaceholder(d)] for d in range(batch_dims)]
    return rows + [[Partial(r), Partial(r)] for r in _PERMUTATION_SAFE_REDUCTIONS]
