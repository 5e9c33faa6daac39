"""Embedding of a weight whose rows (the vocabulary) are sharded on several mesh dims, or into empty shards.

torch's rowwise embedding strategy (`embedding_strategy` in `torch/distributed/tensor/_ops/_embedding_ops.py`)
masks each index against the rows one rank owns (`_MaskPartial`). The mask is worked out per mesh dim from the
whole vocabulary, so with the rows sharded on two mesh dims (`[Shard(0), Shard(0)]`) the second mesh dim masks
against rows its ranks do not hold: WRONG results (or an index error in the local kernel). And a rank whose row
shard is empty (5 rows on 4 ranks: 2, 2, 1, 0) runs `embedding` on a weight with no rows, which fails even for a
masked index. The fix gathers the weight on the offending mesh dims first and then runs DTensor's own path;
a weight with its rows sharded on one mesh dim, every rank holding some, runs exactly as before.

A second fix: with the indices sharded on another mesh dim than the rows (a 2-D mesh: batch on one, vocabulary on
the other), the output is masked on one mesh dim and sharded on an index dim on the other. torch's redistribution to replicated
gathers the sharded mesh dim first, and the mask, made for the ungathered local output, no longer fits (IndexError
in `full_tensor()` or any later gather). Such an output is unmasked (all-reduced on the rows' mesh dim, which every
reader needs anyway) before it is handed out; outputs masked on their only non-replicated mesh dim stay masked.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from dtensor_ext import _compat
from dtensor_ext._compat import MaskPartial, Replicate, Shard
from dtensor_ext.torch_fixes import generic_dispatch, swap_handlers, torch_fix

aten = torch.ops.aten


def _every_rank_gets_rows(rows: int, ranks: int) -> bool:
    """torch's chunking gives each of `ranks` shards ceil(rows / ranks) rows until they run out."""
    return rows >= ranks and math.ceil(rows / math.ceil(rows / ranks)) == ranks


def rows_sharded_where_masking_works(weight) -> tuple:
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
    placements = rows_sharded_where_masking_works(weight)
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


def mask_outgrown(source, target, masked_ndim: int) -> bool:
    """Whether torch's plan from spec `source` to `target` changes the sharding of one of the first `masked_ndim`
    dims (those a `_MaskPartial`'s mask covers) while a mask is live: made before (a masked source, or a step into
    `_MaskPartial`) and not yet reduced."""
    live = {i for i, p in enumerate(source.placements) if isinstance(p, MaskPartial)}
    for mesh_dim, before, after in _compat.redistribution_steps(source, target):
        if isinstance(after, MaskPartial):
            live.add(mesh_dim)
        elif isinstance(before, MaskPartial):
            live.discard(mesh_dim)
        elif live - {mesh_dim} and any(isinstance(p, Shard) and p.dim < masked_ndim for p in (before, after)):
            return True
    return False


def _replicated(spec, where) -> tuple:
    return tuple(Replicate() if where(p) else p for p in spec.placements)


def _indices_moved_before_masking(op_call, args, kwargs):
    """Indices whose move to the spec propagation picks would gather them after masking: moved there except for
    the mask, so that only the masking is left. (A mask outgrows its shape only through a step on another mesh dim,
    so a 1-D mesh is left alone without asking propagation.)"""
    indices = args[1]
    if not isinstance(indices, DTensor) or indices.device_mesh.ndim == 1:
        return args
    target = _compat.suggested_input_specs(op_call, args, kwargs)[1]
    if not mask_outgrown(indices._spec, target, indices.ndim):
        return args
    unmasked = _replicated(target, lambda p: isinstance(p, MaskPartial))
    return (args[0], indices.redistribute(indices.device_mesh, unmasked), *args[2:])


def _unmasked_if_a_gather_would_outgrow_the_mask(output):
    """The mask covers the index dims (all but the last, the embedding dim). An output masked on no mesh dim, or on
    a 1-D mesh, has no mask a later step could outgrow."""
    if output.device_mesh.ndim == 1 or not any(isinstance(p, MaskPartial) for p in output.placements):
        return output
    whole = _compat.DTensorSpec(output.device_mesh, (Replicate(),) * output.device_mesh.ndim,
                                tensor_meta=output._spec.tensor_meta)
    if not mask_outgrown(output._spec, whole, output.ndim - 1):
        return output
    return output.redistribute(output.device_mesh, _replicated(output._spec, lambda p: isinstance(p, MaskPartial)))


def _outgrows_masks() -> bool:
    """Feature check: torch's plan taking a [2, 2] output masked on mesh dim 0 and sharded on its index dim on mesh
    dim 1 of a 2x2 probe mesh to replicated gathers the index dim before the mask is reduced."""
    x = torch.zeros(2, 2)
    masked = MaskPartial(offset_shape=torch.Size([4]), offset_dim=0)
    source = _compat.probe_spec(x, (masked, Shard(0)), (2, 2))
    return mask_outgrown(source, _compat.probe_spec(x, (Replicate(), Replicate()), (2, 2)), 1)


@torch_fix(
    "embedding mask outlived by a gather",
    ops=("aten::embedding.default",),
    why="indices sharded on another mesh dim than the vocabulary: torch's redistribution gathers an index dim while "
    "the mask made for the ungathered shape is live (IndexError in the lookup or in full_tensor())",
)
def fix_embedding_mask_order():
    op = aten.embedding.default
    if not _outgrows_masks():
        return None
    inner = _compat.custom_op_handler(op) or generic_dispatch

    def embedding(op_call, args, kwargs):
        args = _indices_moved_before_masking(op_call, args, kwargs)
        return _unmasked_if_a_gather_would_outgrow_the_mask(inner(op_call, args, kwargs))

    return swap_handlers({op: embedding})
