"""Embedding of a weight whose rows (the vocabulary) are sharded on several mesh dims, or into empty shards.

torch's rowwise embedding strategy (`embedding_strategy` in `torch/distributed/tensor/_ops/_embedding_ops.py`)
masks each index against the rows one rank owns (`_MaskPartial`). The mask is worked out per mesh dim from the
whole vocabulary, so with the rows sharded on two mesh dims (`[Shard(0), Shard(0)]`) the second mesh dim masks
against rows its ranks do not hold: WRONG results (or an index error in the local kernel). And a rank whose row
shard is empty (5 rows on 4 ranks: 2, 2, 1, 0) runs `embedding` on a weight with no rows, which fails even for a
masked index. The fix takes those layouts out of torch's strategy: DTensor's propagation then picks the cheapest
of the others (the weight gathered on one of the mesh dims, or the rows replicated); a weight with its rows
sharded on one mesh dim, every rank holding some, runs exactly as before.

A second fix: with the indices sharded on another mesh dim than the rows (a 2-D mesh: batch on one, vocabulary on
the other), the output is masked on one mesh dim and sharded on an index dim on the other. torch's redistribution
to replicated gathers the sharded mesh dim first, and the mask, made for the ungathered local output, no longer fits
(IndexError in `full_tensor()` or any later gather); the same happens to indices whose move to the layout torch
picks gathers them after masking. The fix takes the layouts whose mask a gather would outgrow out of the strategy
too; outputs masked on their only non-replicated mesh dim stay masked.

Both are strategy filters, not dispatch handlers: DTensor caches the layout it picks, so a lookup runs on DTensor's
own fast path (a handler in Python took embedding off it, 1.07-1.20x the CPU time of torch alone).
"""

from __future__ import annotations

import math

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import MaskPartial, OpSchema, OpSpec, OpStrategy, Replicate, Shard
from dtensor_ext.torch_fixes import Undo, torch_fix
from dtensor_ext.torch_fixes.strategy_swap import filtered_single_dim, single_dim_as_op_strategy, wrap_strategies

aten = torch.ops.aten


def _every_rank_gets_rows(rows: int, ranks: int) -> bool:
    """torch's chunking gives each of `ranks` shards ceil(rows / ranks) rows until they run out."""
    return rows >= ranks and math.ceil(rows / math.ceil(rows / ranks)) == ranks


def rows_sharded_where_masking_works(placements, mesh, rows: int) -> tuple:
    """`placements` of a weight with `rows` rows on `mesh`, its rows replicated on every mesh dim but the first
    that shards them, and on that one too unless every rank gets rows."""
    placements = list(placements)
    row_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    keep = row_dims[:1] if row_dims and _every_rank_gets_rows(rows, mesh.size(row_dims[0])) else []
    for mesh_dim in row_dims:
        if mesh_dim not in keep:
            placements[mesh_dim] = Replicate()
    return tuple(placements)


def keep_layouts(op, keeps) -> Undo:
    """torch's strategy for `op` with only the layouts `keeps(op_schema)(op_spec)` accepts (it must accept
    all-Replicate), whether torch shards `op` with a single-dim rule or an op_strategy function."""
    if _compat.torch_strategy_kind(op) == "single_dim":
        return single_dim_as_op_strategy(op, lambda rule: filtered_single_dim(rule, keeps))

    def wrap(torch_strategy):
        def strategy(op_schema: OpSchema) -> OpStrategy:
            accepts = keeps(op_schema)
            return OpStrategy([s for s in torch_strategy(op_schema).strategies if accepts(s)])

        return strategy

    return wrap_strategies([op], wrap)


def _rows_maskable(op_schema: OpSchema):
    def keeps(spec: OpSpec) -> bool:
        weight = spec.input_specs[0]
        placements = tuple(weight.placements)
        return rows_sharded_where_masking_works(placements, weight.mesh, weight.shape[0]) == placements

    return keeps


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
    return keep_layouts(op, _rows_maskable)


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


def _masks_kept_whole(op_schema: OpSchema):
    """Accepts the layouts whose mask no gather outgrows: neither the move of the indices (as they are now) to the
    layout's indices, nor the output's move to replicated. (A mask outgrows its shape only through a step on
    another mesh dim, so on a 1-D mesh every layout is kept.)"""
    indices = op_schema.args_schema[1]
    if indices.mesh.ndim == 1:
        return lambda spec: True
    now = indices.strategies[0].output_spec if len(indices.strategies) == 1 else None  # tools ask with every layout
    output_meta = _compat.output_tensor_meta(op_schema)

    def keeps(spec: OpSpec) -> bool:
        if now is not None and mask_outgrown(now, spec.input_specs[1], now.ndim):
            return False
        output = spec.output_spec
        if not any(isinstance(p, MaskPartial) for p in output.placements):
            return True
        whole = (Replicate(),) * output.mesh.ndim
        masked_ndim = len(output_meta.shape) - 1  # the mask covers the index dims, not the embedding dim
        return not mask_outgrown(_compat.DTensorSpec(output.mesh, output.placements, tensor_meta=output_meta),
                                 _compat.DTensorSpec(output.mesh, whole, tensor_meta=output_meta), masked_ndim)

    return keeps


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
    if _compat.custom_op_handler(op) is not None or not _outgrows_masks():
        return None
    return keep_layouts(op, _masks_kept_whole)
