"""`torch.linalg.pinv(A, atol=..., rtol=...)` with DTensor tolerances: each tolerance goes where A's batch goes.

The tolerances are keyword-only tensors that broadcast against A's batch dims (one cutoff per matrix). DTensor's
dispatch redistributes positional tensors only, and torch's rule declares the tolerances Replicate whatever A's
batch layout is, so the kernel got them as they came: a Partial tolerance cut the singular values at one rank's
addend (WRONG pseudo-inverse, found by the thorough OpInfo run), and a whole per-matrix tolerance met A's local
batch (an error). The handler keeps torch's choice for A and places each tolerance like A on the batch dims it
has, Replicate elsewhere; the local kernel is then exact with no collective beyond moving the tolerances.
Calls without a DTensor tolerance run DTensor's generic path.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, Placement, Replicate, Shard
from dtensor_ext.torch_fixes import dispatch_moving_keywords, swap_handlers, torch_fix

aten = torch.ops.aten
TOLERANCES = ("atol", "rtol")


def tolerance_placements(matrices: DTensorSpec, tolerance: torch.Size) -> tuple[Placement, ...]:
    """Where a tolerance of shape `tolerance` belongs when the matrices are laid out as `matrices`: its dims align
    with the matrices' batch dims from the right, and a dim of size 1 broadcasts (so stays whole)."""
    batch_dims = matrices.ndim - 2
    placements: list[Placement] = []
    for placement in matrices.placements:
        own_dim = placement.dim - (batch_dims - len(tolerance)) if isinstance(placement, Shard) else -1
        if own_dim < 0 or tolerance[own_dim] == 1:
            placements.append(Replicate())
        elif type(placement) is Shard:
            placements.append(Shard(own_dim))
        else:
            raise NotImplementedError(f"linalg_pinv: matrices placed {placement} on a batch dim the tolerance "
                                      f"has; expected Shard, Replicate or Partial")
    return tuple(placements)


def _like_the_batch(name, tolerance, schema):
    return tolerance_placements(schema.args_schema[0], tolerance.shape)


def _pinv(op_call, args, kwargs):
    batch = args[0].shape[:-2]
    for name in TOLERANCES:
        tolerance = kwargs.get(name)
        if isinstance(tolerance, DTensor) and torch.broadcast_shapes(batch, tolerance.shape) != batch:
            raise NotImplementedError(
                f"{op_call}: keyword {name} of shape {tuple(tolerance.shape)} broadcasts the batch dims "
                f"{tuple(batch)} of the matrices to more pseudo-inverses than there are matrices; expected a "
                f"tolerance broadcastable to {tuple(batch)}"
            )
    return dispatch_moving_keywords(op_call, args, kwargs, _like_the_batch)


@functools.cache
def _tolerances_left_in_place() -> bool:
    """Feature check, run as rank 0 of a 2-rank probe mesh: two 2x2 matrices sharded on their batch dim, with a
    whole per-matrix `rtol` (rank 0's matrix needs only its own entry, a local chunk). Where DTensor hands the
    kernel the whole tolerance, rank 0 computes the wrong cutoff or fails; no strategy means nothing to fix."""
    matrices = torch.tensor([[[1.0, 0.0], [0.0, 0.2]], [[1.0, 0.0], [0.0, 0.5]]])
    rtol = torch.tensor([0.3, 0.1])
    with _compat.probing_dtensor_ops():
        local_matrices = _compat.probe_dtensor(matrices[:1], (Shard(0),), matrices.shape)
        whole_rtol = _compat.probe_dtensor(rtol, (Replicate(),), rtol.shape)
        try:
            out = torch.linalg.pinv(local_matrices, rtol=whole_rtol)
        except NotImplementedError:
            return False
        except RuntimeError:
            return True
    expected = torch.linalg.pinv(matrices[:1], rtol=rtol[:1])
    return out.to_local().shape != expected.shape or not torch.allclose(out.to_local(), expected)


@torch_fix(
    "pinv keyword tolerances",
    ops=("aten::linalg_pinv.atol_rtol_tensor",),
    why="DTensor never moves keyword tensors and torch's rule declares atol/rtol Replicate: a Partial tolerance "
    "gives a WRONG pseudo-inverse, a per-matrix tolerance on batch-sharded matrices an error",
)
def fix_pinv_tolerances():
    op = aten.linalg_pinv.atol_rtol_tensor
    if _compat.custom_op_handler(op) is not None or not _tolerances_left_in_place():
        return None
    return swap_handlers({op: _pinv})
