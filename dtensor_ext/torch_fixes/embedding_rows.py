"""Embedding of a weight whose rows (the vocabulary) are sharded on several mesh dims, or into empty shards.

torch's rowwise embedding strategy (`embedding_strategy` in `torch/distributed/tensor/_ops/_embedding_ops.py`)
masks each index against the rows one rank owns (`_MaskPartial`). The mask is worked out per mesh dim from the
whole vocabulary, so with the rows sharded on two mesh dims (`[Shard(0), Shard(0)]`) the second mesh dim masks
against rows its ranks do not hold: WRONG results (or an index error in the local kernel). And a rank whose row
shard is empty (5 rows on 4 ranks: 2, 2, 1, 0) runs `embedding` on a weight with no rows, which fails even for a
masked index. The fix gathers the weight on the offending mesh dims first and then runs DTensor's own path;
a weight with its rows sharded on one mesh dim, every rank holding some, runs exactly as before.
"""

from __future__ import annotations

import math

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Replicate, Shard
from dtensor_ext.torch_fixes import swap_handlers, torch_fix

aten = torch.ops.aten


def _every_rank_gets_rows(rows: int, ranks: int) -> bool:
    """torch's chunking gives each of `ranks` shards ceil(rows / ranks) rows until they run out."""
    return rows >= ranks and math.ceil(rows / math.ceil(rows / ranks)) == ranks


def _rows_sharded_where_masking_works(weight) -> tuple:
    placements = list(weight.placements)
    row_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    mesh = weight.device_mesh
    keep = row_dims[:1] if row_dims and _every_rank_gets_rows(weight.shape[0], mesh.size(row_dims[0])) else []
    for mesh_dim in row_dims:
        if mesh_dim not in keep:
            placements[mesh_dim] = Replicate()
    return tuple(placements)


def _embedding(op_call, args, kwargs):
    weight = args[0]
    placements = _rows_sharded_where_masking_works(weight)
    if placements != tuple(weight.placements):
        args = (weight.redistribute(weight.device_mesh, placements), *args[1:])
    op_info, sharding, _ = _compat.propagate_and_redistribute(op_call, args, kwargs)
    local = op_call(*op_info.local_args, **op_info.local_kwargs)
    return _compat.wrap_local_results(local, sharding.output_spec)


def _masks_rows_it_cannot(op) -> bool:
    """Feature check: whether torch's propagation keeps a weight's rows sharded (a masked Partial output) where
    masking fails: [4, 2] rows sharded on both dims of a 2x2 probe mesh, or 1 row over 2 ranks (an empty shard)."""
    ids = _compat.probe_spec(torch.zeros(2, dtype=torch.long), (Replicate(),) * 2, (2, 2))
    twice = _compat.probe_spec(torch.zeros(4, 2), (Shard(0), Shard(0)), (2, 2))
    if _masked(_compat.output_placements(op, (twice, ids))) == 2:
        return True
    ids = _compat.probe_spec(torch.zeros(2, dtype=torch.long), (Replicate(),))
    return _masked(_compat.output_placements(op, (_compat.probe_spec(torch.zeros(1, 2), (Shard(0),)), ids))) == 1


def _masked(placements: tuple | None) -> int:
    return sum(p.is_partial() for p in placements or ())


@torch_fix(
    "embedding rows sharded twice or into empty shards",
    ops=("aten::embedding.default",),
    why="rows sharded on two mesh dims are masked against the wrong rows (WRONG results); an empty row shard "
    "makes the local kernel fail",
)
def fix_embedding_rows():
    op = aten.embedding.default
    if _compat.custom_op_handler(op) is not None or not _masks_rows_it_cannot(op):
        return None
    return swap_handlers({op: _embedding})
