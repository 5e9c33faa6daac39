"""torch rules declared for even shards only whose layouts are exact on uneven shards: communicating for nothing.

torch registers upsampling, grid sampling, max-unpooling, `constant_pad_nd` and `roll` as single-dim rules with
`allow_uneven_sharding=False`, so a batch of 2 over 4 ranks (1, 1, 0, 0) or 5 channels over 4 (2, 2, 1, 0) is
all-gathered before a kernel that works on each sample and channel on its own. The rules shard only dims the
kernel treats independently (batch and channels; for pad and roll the dims not padded or rolled), so every
row is as exact on uneven shards as on even ones, except where a rank's shard is empty and the CPU kernel rejects
it: the upsampling and max-unpooling kernels refuse an empty channel or spatial dim ("Non-empty 4D data tensor
expected"), so those layouts are dropped (`empty_shards.feeds_every_rank`) and DTensor picks the next cheapest.
Where the running torch already allows uneven shards for an op, it is left alone.
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext.torch_fixes import applied_to, torch_fix, undo_all
from dtensor_ext.torch_fixes.empty_shards import GuardedDims, _non_batch_dims, feeds_every_rank
from dtensor_ext.torch_fixes.strategy_swap import filtered_single_dim, single_dim_as_op_strategy

aten = torch.ops.aten


def _nothing_guarded(op_schema) -> tuple[int, ...]:
    return ()


# op -> the dims of its first input that no rank may hold empty (the kernel rejects them)
UNEVEN_EXACT: dict = {
    **{op: _non_batch_dims(1) for op in (aten.upsample_nearest1d.default, aten._upsample_nearest_exact1d.default,
                                        aten.upsample_linear1d.default)},
    **{op: _non_batch_dims(2) for op in (aten.upsample_nearest2d.default, aten._upsample_nearest_exact2d.default,
                                        aten.upsample_bilinear2d.default, aten.upsample_bicubic2d.default,
                                        aten.max_unpool2d.default)},
    **{op: _non_batch_dims(3) for op in (aten.upsample_nearest3d.default, aten._upsample_nearest_exact3d.default,
                                        aten.upsample_trilinear3d.default, aten.max_unpool3d.default)},
    **dict.fromkeys((aten.grid_sampler_2d.default, aten.grid_sampler_3d.default, aten.constant_pad_nd.default,
                     aten.roll.default), _nothing_guarded),
}


def _allow_uneven(op, guarded_dims: GuardedDims):
    info = _compat.single_dim_info_allowing_uneven(op)
    return single_dim_as_op_strategy(op, lambda rule: filtered_single_dim(info, feeds_every_rank(guarded_dims)))


@torch_fix(
    "even-only rules exact on uneven shards",
    ops=tuple(_compat.torch_op_names(op)[0] for op in UNEVEN_EXACT),
    why="torch declares these single-dim rules even-only, so an uneven batch or channel dim is all-gathered "
    "although each rank's kernel computes its own samples and channels exactly",
)
def fix_uneven_rules():
    undos = {op: _allow_uneven(op, guard) for op, guard in UNEVEN_EXACT.items() if _compat.single_dim_even_only(op)}
    return applied_to(list(undos), undo_all(list(undos.values()))) if undos else None
