"""`F.embedding(..., max_norm=...)` of a sharded weight: the in-place renorm of the rows the indices name.

`F.embedding` with `max_norm` first rescales, in place, every weight row an index names whose norm exceeds
`max_norm` (`aten.embedding_renorm_`). torch's only strategy replicates the weight, so an in-place renorm of a
vocab-sharded (or column-sharded, or Partial) weight is refused ("in-place operations that require placement
changes"). Each row is rescaled on its own, so the exact local answer exists where the rows are sharded: every rank
renorms the rows it owns that the indices name (the indices replicated, shifted by the rank's first row; an index
of another rank's row points at a zero row appended for the call, which no renorm touches). A row's norm needs the
whole row, so a weight sharded on its columns or Partial is made whole first (rows kept sharded where they are),
renormed, and written back in its own layout: the weight and every view of it keep their placements.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from dtensor_ext import _compat
from dtensor_ext._compat import Replicate, Shard
from dtensor_ext.torch_fixes import applied_to, generic_dispatch, swap_handlers, torch_fix
from dtensor_ext.torch_fixes.embedding_rows import rows_sharded_where_masking_works

aten = torch.ops.aten


@_compat.per_simulated_rank
def _renorm_owned_rows(local: torch.Tensor, indices: torch.Tensor, count: int, first: int, max_norm: float,
                       norm_type: float) -> None:
    shifted = indices - first
    elsewhere = (shifted < 0) | (shifted >= count)
    padded = torch.cat([local, local.new_zeros(1, local.shape[1])])
    aten.embedding_renorm_(padded, shifted.masked_fill(elsewhere, count), max_norm, norm_type)
    local.copy_(padded[:-1])


def _renorm_in_place(op_call, args, kwargs):
    named = {**dict(zip(("self", "indices", "max_norm", "norm_type"), args)), **kwargs}
    weight, indices, max_norm, norm_type = named["self"], named["indices"], named["max_norm"], named["norm_type"]
    if all(isinstance(p, Replicate) for p in weight.placements) or not isinstance(indices, DTensor):
        return generic_dispatch(op_call, args, kwargs)
    mesh = weight.device_mesh
    rows_kept = rows_sharded_where_masking_works(weight.placements, mesh, weight.shape[0])
    working = tuple(p if isinstance(p, Shard) and p.dim == 0 and p == kept else Replicate()
                    for p, kept in zip(weight.placements, rows_kept))
    work = weight if working == tuple(weight.placements) else weight.redistribute(mesh, working)
    whole_indices = indices.redistribute(mesh, (Replicate(),) * mesh.ndim)._local_tensor
    row_dims = [i for i, p in enumerate(working) if isinstance(p, Shard)]
    if row_dims:
        count, first = _compat.own_rows(weight.shape[0], mesh, row_dims[0])
        _renorm_owned_rows(work._local_tensor, whole_indices, count, first, max_norm, norm_type)
    else:
        aten.embedding_renorm_(work._local_tensor, whole_indices, max_norm, norm_type)
    if work is not weight:
        moved = _compat.dispatch_redistributor()(work._local_tensor, work._spec, weight._spec)
        weight._local_tensor.copy_(moved)
    return weight


def _refuses_sharded_rows() -> bool:
    """Feature check: torch's propagation of the renorm of a [4, 2] weight sharded on its rows over a 2-rank probe
    mesh (replicated indices) keeps no Shard(0) weight: it refuses, or moves the weight, which in place fails."""
    weight = _compat.probe_spec(torch.zeros(4, 2), (Shard(0),))
    ids = _compat.probe_spec(torch.zeros(2, dtype=torch.long), (Replicate(),))
    return _compat.output_placements(aten.embedding_renorm_.default, (weight, ids, 1.0, 2.0)) != (Shard(0),)


@torch_fix(
    "embedding max_norm of a sharded weight",
    ops=("aten::embedding_renorm_.default",),
    why="F.embedding(..., max_norm=) of a vocab-sharded, column-sharded or Partial weight is refused: the in-place "
    "renorm has only a replicated strategy",
)
def fix_embedding_renorm():
    op = aten.embedding_renorm_.default
    if _compat.custom_op_handler(op) is not None or not _refuses_sharded_rows():
        return None
    return applied_to([op], swap_handlers({op: _renorm_in_place}))
