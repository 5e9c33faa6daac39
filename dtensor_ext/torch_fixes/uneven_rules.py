"""torch rules declared for even shards only whose layouts are exact on uneven shards: communicating for nothing.

torch registers upsampling, grid sampling, max-unpooling, the backwards of 2-D max pooling and adaptive average
pooling, `constant_pad_nd` and `roll` as single-dim rules with `allow_uneven_sharding=False`, so a batch of 2 over
4 ranks (1, 1, 0, 0) or 5 channels over 4 (2, 2, 1, 0) is all-gathered before a kernel that works on each sample
and channel on its own. The rules shard only dims the kernel treats independently (batch and channels; for pad and
roll the dims not padded or rolled), so every row is as exact on uneven shards as on even ones, except where a
rank's shard is empty and the CPU kernel rejects it: the upsampling, max-unpooling and pooling-backward kernels
refuse an empty channel or spatial dim ("Non-empty 4D data tensor expected"), so those layouts are dropped
(`empty_shards.feeds_every_rank`) and DTensor picks the next cheapest.
Where the running torch already allows uneven shards for an op, it is left alone.

Pooling (max, average, adaptive; torch 2.12/2.13) is an op_strategy that shards the batch, and the channels of a
batched input, only where the dim has at least one row per rank: a batch of 1 over 4 ranks is all-gathered,
where 2.15's single-dim pooling rule (allow_uneven_sharding) keeps it. `F.local_response_norm` pads a batch-sharded
input (the pad keeps the shard) and then pools it: the gather moved the padded tensor, one channel more than torch
alone, whose even-only pad had gathered before padding. Where a probe finds torch's pooling strategy replicating a
batch of 1 on 2 ranks, the fix gives the op the same rows as an uneven single-dim rule (batch; channels when
batched; Partial sum/avg through the averaging pools), without the layouts that leave a rank an empty dim its
kernel rejects (probed per op).
"""

from __future__ import annotations

import dataclasses

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import OpSchema, OpSpec, OpStrategy, Partial, Replicate, Shard, ShardingPlaceholder, TensorMeta
from dtensor_ext.torch_fixes import Undo, applied_to, replace_rule, restorer, torch_fix, undo_all
from dtensor_ext.torch_fixes.empty_shards import GuardedDims, _every_dim, _non_batch_dims, feeds_every_rank
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
                                        aten.max_unpool2d.default, aten.max_pool2d_with_indices_backward.default,
                                        aten._adaptive_avg_pool2d_backward.default)},
    **{op: _non_batch_dims(3) for op in (aten.upsample_nearest3d.default, aten._upsample_nearest_exact3d.default,
                                        aten.upsample_trilinear3d.default, aten.max_unpool3d.default)},
    **dict.fromkeys((aten.grid_sampler_2d.default, aten.grid_sampler_3d.default, aten.constant_pad_nd.default,
                     aten.roll.default), _nothing_guarded),
}


def _allow_uneven(op, guarded_dims: GuardedDims) -> Undo | None:
    """torch's even-only rule for `op` allowed uneven shards, behind the filter of `guarded_dims`; None where torch's
    rule allows them already. The rule may sit behind an earlier fix's filter (empty_shards moves
    max_pool2d_with_indices_backward's there): that filter is replaced, `guarded_dims` being at least as strict."""
    if _compat.single_dim_even_only(op):
        info = _compat.single_dim_info_allowing_uneven(op)
        return single_dim_as_op_strategy(op, lambda rule: filtered_single_dim(info, feeds_every_rank(guarded_dims)))
    snapshot = _compat.snapshot_registration(op)
    info = getattr(snapshot.get("op_strategy_funcs"), "single_dim_info", None)
    if info is None or getattr(info, "allow_uneven_sharding", True):
        return None
    undo = restorer(op)
    info = dataclasses.replace(info, allow_uneven_sharding=True)
    strategy = filtered_single_dim(info, feeds_every_rank(guarded_dims))
    strategy.single_dim_info = info  # stays discoverable: _compat.single_dim_func
    _compat.register_op_strategy(op, strategy, schema_info=snapshot.get("op_to_schema_info"))
    return undo


# pooling op -> (its spatial dims, whether it averages: Partial sum/avg pass through a linear pool); each takes
# (input, [2] * spatial, ...) as its kernel or output size
POOLS: dict = {
    **{op: (k, True) for k, op in enumerate((aten.avg_pool1d.default, aten.avg_pool2d.default,
                                             aten.avg_pool3d.default), 1)},
    **{op: (k, True) for k, op in enumerate((aten.adaptive_avg_pool1d.default, aten._adaptive_avg_pool2d.default,
                                             aten._adaptive_avg_pool3d.default), 1)},
    **{op: (k, False) for k, op in enumerate((aten.adaptive_max_pool1d.default, aten.adaptive_max_pool2d.default,
                                              aten.adaptive_max_pool3d.default), 1)},
    **{op: (k, False) for k, op in enumerate((aten.max_pool1d_with_indices.default,
                                              aten.max_pool2d_with_indices.default,
                                              aten.max_pool3d_with_indices.default), 1)},
}


def pooling_rule(op, args_meta, kwargs_meta):
    """A pool computes each (sample, channel) plane on its own: shard the batch, or the channels of a batched
    ([N, C, *spatial]) input, in every output (values and indices) and the input alike; an averaging pool is
    linear, so a Partial sum or average input gives the same Partial output."""
    spatial, averages = POOLS[op]
    width = len(op._schema.returns) + sum(isinstance(a, TensorMeta) for a in args_meta)
    rows = [[ShardingPlaceholder(0)] * width]
    if len(args_meta[0].shape) == spatial + 2:
        rows.append([ShardingPlaceholder(1)] * width)
    return rows + ([[Partial(r)] * width for r in ("sum", "avg")] if averages else [])


def _rejects(op, shape: tuple[int, ...], spatial: int) -> bool:
    try:
        with _compat.outside_dispatch_modes():
            op(torch.zeros(shape), [2] * spatial)
    except (RuntimeError, IndexError):
        return True
    return False


def _pool_guard(op) -> GuardedDims:
    """The dims no rank may hold empty: probed on the CPU kernel with an empty batch, then empty channels."""
    spatial, _ = POOLS[op]
    if _rejects(op, (0, 2, *[4] * spatial), spatial):
        return _every_dim
    return _non_batch_dims(spatial) if _rejects(op, (1, 0, *[4] * spatial), spatial) else _nothing_guarded


def _pool_needs_full_rows(op) -> bool:
    """Feature check: torch's pooling op_strategy replicates a batch of 1 sharded over a 2-rank probe mesh."""
    if _compat.torch_strategy_kind(op) != "op_strategy":
        return False  # a single-dim rule (2.15 allows uneven shards), or no strategy at all (2.11)
    spatial, _ = POOLS[op]
    x = _compat.probe_spec(torch.zeros(1, 2, *[4] * spatial), (Shard(0),))
    placements = _compat.output_placements(op, (x, [2] * spatial))
    return placements is not None and isinstance(placements[0], Replicate)


def _layout(spec: OpSpec) -> tuple:
    outputs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
    return (tuple(None if o is None else o.placements for o in outputs),
            tuple(i.placements for i in spec.input_specs or ()))


def _uneven_pool(op) -> Undo:
    """torch's pooling strategy (as registered now: empty_shards may filter it) plus the uneven layouts of
    `pooling_rule` it does not offer. torch's own layouts stay, so its full-mesh search keeps every choice it had
    (a Partial input reduce-scattered onto the channels of a 2x2 mesh, which the single-dim expansion does not
    consider); DTensor picks the cheapest of both."""
    before = _compat.snapshot_registration(op)
    torch_strategy = before["op_strategy_funcs"]
    undo = replace_rule(op, pooling_rule, schema_info=_compat.RuntimeSchemaInfo(1))
    record = _compat.snapshot_registration(op)["op_single_dim_strategy_funcs"]
    uneven = filtered_single_dim(record, feeds_every_rank(_pool_guard(op)))

    def strategy(op_schema: OpSchema) -> OpStrategy:
        offered = torch_strategy(op_schema)
        known = {_layout(s) for s in offered.strategies}
        return OpStrategy([*offered.strategies, *(s for s in uneven(op_schema).strategies if _layout(s) not in known)])

    strategy.single_dim_info = record  # stays discoverable: _compat.single_dim_func
    _compat.restore_registration(op, {})
    _compat.register_op_strategy(op, strategy, schema_info=before.get("op_to_schema_info"))
    return undo


@torch_fix(
    "even-only rules exact on uneven shards",
    ops=tuple(_compat.torch_op_names(op)[0] for op in (*UNEVEN_EXACT, *POOLS)),
    why="torch declares these single-dim rules even-only (and shards pooling only with a row per rank), so an "
    "uneven batch or channel dim is all-gathered although each rank's kernel computes its own samples and "
    "channels exactly",
)
def fix_uneven_rules():
    undos = {op: undo for op, guard in UNEVEN_EXACT.items() if (undo := _allow_uneven(op, guard)) is not None}
    undos.update({op: _uneven_pool(op) for op in POOLS if _pool_needs_full_rows(op)})
    return applied_to(list(undos), undo_all(list(undos.values()))) if undos else None
