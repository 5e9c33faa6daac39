"""An embedding (or gather) output that is still `_MaskPartial` can be read only once by torch.

A vocab-sharded embedding returns `_MaskPartial`: each rank looked up rows it does not own and keeps a mask of them,
zeroed when the partial sum is reduced. torch releases the mask after the first reduction, so a second consumer of
the same tensor (Hugging Face's RMSNorm reads its input twice; the residual add reads it again) hits a bare
`AssertionError` in `_MaskPartial._reduce_value`. The mask belongs to the tensor, not to one read: at the first
reduction the fix takes a reference of its own on the mask, so torch's release leaves it for the next readers
(masking again is idempotent: torch zeroes the rows in the local tensor itself), and each later read adds the
reference its reduction releases.

DTensor caches the strategy it picks, so every lookup of the same shapes shares one placement, hence one mask
buffer: the next step's lookup (or, under torch.compile, AOTAutograd's trace after dynamo's) partitions new indices
into the buffer the fix still holds. The fix lets go of its reference first, so the buffer takes the new mask as it
does in torch alone; holding on would compare the new mask with the old one (eager: "MaskBuffer has been
materialized with conflicting data" at the second step; compile: a mask of dynamo's fake mode compared with one of
AOTAutograd's, "Mixing fake modes").
"""

from __future__ import annotations

import weakref

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import MaskPartial
from dtensor_ext.torch_fixes import torch_fix


def _releases_mask_on_reduction() -> bool:
    """Whether torch's `_MaskPartial` reduction drops the mask (probed with one masked row and no mesh: the
    masking and the release come before the collective, which then fails)."""
    placement = MaskPartial(offset_shape=torch.Size([2]), offset_dim=0)
    placement.mask_buffer.materialize_mask(torch.tensor([True, False]))
    try:
        placement._reduce_value(torch.ones(2, 1), None, 0)
    except Exception:  # the collective has no mesh to run on; the probe only reads the buffer below
        pass
    return placement.mask_buffer.data is None


def _moved_masks(current_spec, target_spec) -> tuple[list, list]:
    """(buffers a move reduces, buffers it partitions into): a `_MaskPartial` left or entered on some mesh dim."""
    reduced, partitioned = [], []
    for current, target in zip(current_spec.placements, target_spec.placements):
        if current != target:  # a _MaskPartial equals only itself (the same buffer)
            if isinstance(current, MaskPartial):
                reduced.append(current.mask_buffer)
            if isinstance(target, MaskPartial):
                partitioned.append(target.mask_buffer)
    return reduced, partitioned


@torch_fix(
    "_MaskPartial read twice",
    ops=("(reductions of _MaskPartial inputs)",),
    why="a vocab-sharded embedding output read by two ops raises AssertionError: the first reduction drops the mask",
)
def fix_mask_partial_reads():
    if not _releases_mask_on_reduction():
        return None
    torch_redistribute = _compat.dispatch_redistributor()
    held = weakref.WeakValueDictionary()  # id -> mask buffer on which the fix holds one reference

    def let_go(buffer) -> None:
        if held.pop(id(buffer), None) is not None and buffer.refcount > 0:
            buffer.release_mask()

    def keep(buffer) -> None:
        if buffer.data is None:
            return  # nothing to keep: torch's own check reports the read
        if id(buffer) not in held:
            buffer.refcount += 1  # the fix's reference: torch's release leaves the mask for later reads
            held[id(buffer)] = buffer
        elif buffer.refcount == 1:
            buffer.refcount += 1  # only the fix's reference is left: this read's reduction releases the one added

    def redistribute(local_tensor, current_spec, target_spec, **kwargs):
        reduced, partitioned = _moved_masks(current_spec, target_spec)
        for buffer in partitioned:
            let_go(buffer)
        for buffer in reduced:
            keep(buffer)
        return torch_redistribute(local_tensor, current_spec, target_spec, **kwargs)

    def undo() -> None:
        _compat.set_dispatch_redistributor(torch_redistribute)
        for buffer in list(held.values()):
            let_go(buffer)

    _compat.set_dispatch_redistributor(redistribute)
    return undo
