"""An embedding (or gather) output that is still `_MaskPartial` can be read only once by torch.

A vocab-sharded embedding returns `_MaskPartial`: each rank looked up rows it does not own and keeps a mask of them,
zeroed when the partial sum is reduced. torch releases the mask after the first reduction, so a second consumer of
the same tensor (Hugging Face's RMSNorm reads its input twice; the residual add reads it again) hits a bare
`AssertionError` in `_MaskPartial._reduce_value`. The mask belongs to the tensor, not to one read: the fix takes
one more reference on the mask before each reduction torch carries out, so torch's release leaves it in place for
the next reader. Masking again is idempotent (torch zeroes the rows in the local tensor itself).
"""

from __future__ import annotations

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


def _kept_masks(spec) -> list:
    return [p.mask_buffer for p in spec.placements if isinstance(p, MaskPartial) and p.mask_buffer.data is not None]


@torch_fix(
    "_MaskPartial read twice",
    ops=("(reductions of _MaskPartial inputs)",),
    why="a vocab-sharded embedding output read by two ops raises AssertionError: the first reduction drops the mask",
)
def fix_mask_partial_reads():
    if not _releases_mask_on_reduction():
        return None
    torch_redistribute = _compat.dispatch_redistributor()

    def redistribute(local_tensor, current_spec, target_spec, **kwargs):
        for buffer in _kept_masks(current_spec):
            buffer.refcount += 1  # one more holder: torch's release leaves the mask for later reads
        return torch_redistribute(local_tensor, current_spec, target_spec, **kwargs)

    _compat.set_dispatch_redistributor(redistribute)
    return lambda: _compat.set_dispatch_redistributor(torch_redistribute)
