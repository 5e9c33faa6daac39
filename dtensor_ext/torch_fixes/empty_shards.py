"""Layouts that leave a rank an empty shard its local kernel rejects: DTensor picks a layout that runs instead.

DTensor splits a sharded dim like `torch.chunk`, so 5 rows over 4 ranks are held as 2, 2, 1, 0 and one rank holds
an empty shard; torch offers such layouts (its `is_tensor_shardable` only asks for size >= number of shards). Some
local kernels raise on an empty input although the op's result on it is simply empty: the MKL FFTs
(`_fft_c2c/_fft_r2c/_fft_c2r`; the 2.15 CPU FFT takes empty input), batch norm in training mode, pooling with no
channels (max/avg pools, adaptive max pools, 3-D adaptive avg pool; 2.15's single-dim pooling rules shard the
channel dim), `max`/`min` without a dim, `amax`/`amin`/`aminmax`/`argmax`/`argmin` over an empty dim and
`linalg_vector_norm` for orders without an identity (inf, negative). Each kernel is probed on its own, and
`registry()` lists as fixed only the ops whose probe found the rejection and that DTensor shards at all (2.11 has
no strategy for the FFTs or pooling: they are "not needed" there). Ops torch shards only through its decomposition
fallback (2.12's batch norm without stats, 2.11's `norm.Scalar`; the fallback then runs the op's own kernel on every
shard) are steered there, where a feature check finds the fallback sharding them. Where a
feature check finds the running torch's CPU kernel rejecting an empty input, these ops' strategies lose exactly
the layouts that leave some rank an empty shard of a dim the kernel needs non-empty; DTensor's cost model then
picks the cheapest layout left (argmax/argmin, which torch runs through a custom handler, get their input moved
before the handler runs). Every other layout (even shards, empty shards of a dim the kernel accepts empty, calls whose
arguments the kernel takes empty) is offered as torch offers it.

`max`/`min`/`amax`/`amin` could keep the empty shard if that rank contributed the reduction's identity to
`Partial(max/min)`, but that needs a local kernel of ours, and integer and bool inputs have no infinite identity;
avoiding the empty shard is what the op's own kernel can run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, OpSpec, OpStrategy, Replicate
from dtensor_ext.torch_fixes import Undo, applied_to, swap_handlers, torch_fix, undo_all
from dtensor_ext.torch_fixes.strategy_swap import (
    filtered_single_dim, input_spec, single_dim_as_op_strategy, strategy_for_moved_inputs, wrap_strategies,
)

aten = torch.ops.aten

GuardedDims = Callable[[OpSchema], tuple[int, ...]]


@dataclass(frozen=True)
class EmptyRejecting:
    """How one op's kernel treats an empty input."""

    # the arguments of a call on a small input with an empty dim under which the kernel should reject it
    probe_args: Callable[[], tuple]
    # the dims of the first tensor input that no rank may hold empty in this call (() where the call takes empty)
    guarded_dims: GuardedDims


def _arg(op_schema: OpSchema, name: str, default: object) -> object:
    names = [a.name for a in op_schema.op._schema.arguments]
    index = names.index(name)
    if index < len(op_schema.args_schema):
        return op_schema.args_schema[index]
    return op_schema.kwargs_schema.get(name, default)


def _ndim(op_schema: OpSchema) -> int:
    return op_schema.args_schema[0].ndim  # an OpStrategy while propagating, a DTensorSpec in a handler


def _every_dim(op_schema: OpSchema) -> tuple[int, ...]:
    return tuple(range(_ndim(op_schema)))


def _every_dim_when_training(op_schema: OpSchema) -> tuple[int, ...]:
    has_training_arg = any(a.name == "training" for a in op_schema.op._schema.arguments)
    training = _arg(op_schema, "training", None) if has_training_arg else True  # _batch_norm_with_update trains
    return _every_dim(op_schema) if training else ()


def _reduced_dims(op_schema: OpSchema) -> tuple[int, ...]:
    """The dims the op's `dim` argument reduces (None or [] reduce every dim; ops without `dim` reduce all)."""
    has_dim_arg = any(a.name == "dim" for a in op_schema.op._schema.arguments)
    dims = _arg(op_schema, "dim", None) if has_dim_arg else None
    ndim = _ndim(op_schema)
    if dims is None or ndim == 0 or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return _every_dim(op_schema)  # a 0-dim tensor takes dim 0 or -1 and has no dim to shard
    return tuple(d % ndim for d in (dims if isinstance(dims, (list, tuple)) else [dims]))


def _reduced_dims_without_identity(op_schema: OpSchema) -> tuple[int, ...]:
    order_name = "ord" if op_schema.op is aten.linalg_vector_norm.default else "p"
    order = _arg(op_schema, order_name, 2)
    if order is None or not (order < 0 or math.isinf(order)):
        return ()  # sum-like norms reduce an empty shard to 0, and the kernel does so
    return _reduced_dims(op_schema)


def _non_batch_dims(spatial: int) -> GuardedDims:
    """A pooling kernel takes an empty batch but no empty channel or spatial dim: the last `spatial` + 1 dims of
    its input ([N,] C, *spatial)."""

    def dims(op_schema: OpSchema) -> tuple[int, ...]:
        ndim = _ndim(op_schema)
        return tuple(range(max(ndim - spatial - 1, 0), ndim))

    return dims


def _no_rows(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(0, 4, dtype=dtype)


def _no_channels(*batch_and_spatial: int) -> torch.Tensor:
    """A batch norm or pooling input with 0 channels; without sizes, a per-channel vector (running stats) of 0
    channels."""
    return torch.zeros(*batch_and_spatial[:1], 0, *batch_and_spatial[1:])


def kernels() -> dict:
    """The ops whose CPU kernel may reject an empty input, with a probe and the dims each call needs non-empty."""
    return {
        aten._fft_c2c.default: EmptyRejecting(lambda: (_no_rows(torch.cfloat), [1], 0, True), _every_dim),
        aten._fft_r2c.default: EmptyRejecting(lambda: (_no_rows(), [1], 0, True), _every_dim),
        aten._fft_c2r.default: EmptyRejecting(lambda: (_no_rows(torch.cfloat), [1], 0, 6), _every_dim),
        aten.native_batch_norm.default: EmptyRejecting(
            lambda: (_no_channels(2, 3), None, None, None, None, True, 0.1, 1e-5),
            _every_dim_when_training,
        ),
        aten._native_batch_norm_legit.default: EmptyRejecting(
            lambda: (_no_channels(2, 3), None, None, _no_channels(), _no_channels(), True, 0.1, 1e-5),
            _every_dim_when_training,
        ),
        aten._native_batch_norm_legit.no_stats: EmptyRejecting(
            lambda: (_no_channels(2, 3), None, None, True, 0.1, 1e-5),
            _every_dim_when_training,
        ),
        aten._batch_norm_with_update.default: EmptyRejecting(
            lambda: (_no_channels(2, 3), _no_channels(), _no_channels(), _no_channels(), _no_channels(), 0.1, 1e-5),
            _every_dim_when_training,
        ),
        aten.avg_pool1d.default: EmptyRejecting(lambda: (_no_channels(1, 4), [2]), _non_batch_dims(1)),
        aten.max_pool1d_with_indices.default: EmptyRejecting(
            lambda: (_no_channels(1, 4), [2]), _non_batch_dims(1)
        ),
        aten.max_pool2d_with_indices.default: EmptyRejecting(
            lambda: (_no_channels(1, 4, 4), [2, 2]), _non_batch_dims(2)
        ),
        aten.max_pool2d_with_indices_backward.default: EmptyRejecting(
            lambda: (_no_channels(1, 2, 2), _no_channels(1, 4, 4), [2, 2], [2, 2], [0, 0], [1, 1], False,
                     _no_channels(1, 2, 2).long()),
            _non_batch_dims(2),
        ),
        aten.max_pool3d_with_indices.default: EmptyRejecting(
            lambda: (_no_channels(1, 2, 4, 4), [2, 2, 2]), _non_batch_dims(3)
        ),
        aten.avg_pool2d.default: EmptyRejecting(lambda: (_no_channels(1, 4, 4), [2, 2]),
                                                _non_batch_dims(2)),
        aten.avg_pool3d.default: EmptyRejecting(lambda: (_no_channels(1, 2, 4, 4), [2, 2, 2]),
                                                _non_batch_dims(3)),
        aten.adaptive_max_pool2d.default: EmptyRejecting(
            lambda: (_no_channels(1, 4, 4), [2, 2]), _non_batch_dims(2)
        ),
        aten.adaptive_max_pool3d.default: EmptyRejecting(
            lambda: (_no_channels(1, 2, 4, 4), [2, 2, 2]), _non_batch_dims(3)
        ),
        aten._adaptive_avg_pool3d.default: EmptyRejecting(
            lambda: (_no_channels(1, 2, 4, 4), [2, 2, 2]), _non_batch_dims(3)
        ),
        aten.max.default: EmptyRejecting(lambda: (_no_rows(),), _every_dim),
        aten.min.default: EmptyRejecting(lambda: (_no_rows(),), _every_dim),
        aten.amax.default: EmptyRejecting(lambda: (_no_rows(),), _reduced_dims),
        aten.amin.default: EmptyRejecting(lambda: (_no_rows(),), _reduced_dims),
        aten.aminmax.default: EmptyRejecting(lambda: (_no_rows(),), _reduced_dims),
        aten.argmax.default: EmptyRejecting(lambda: (_no_rows(),), _reduced_dims),
        aten.argmin.default: EmptyRejecting(lambda: (_no_rows(),), _reduced_dims),
        aten.linalg_vector_norm.default: EmptyRejecting(
            lambda: (_no_rows(), float("inf")), _reduced_dims_without_identity
        ),
        aten.norm.Scalar: EmptyRejecting(lambda: (_no_rows(), float("inf")),
                                         _reduced_dims_without_identity),
    }


def rejects_empty_input(op, kernel: EmptyRejecting) -> bool:
    """The feature check: whether the running torch's kernel raises on the probe's empty input."""
    try:
        with _compat.outside_dispatch_modes():  # the real kernel, also when install() runs under a fake mode
            op(*kernel.probe_args())
    except (RuntimeError, IndexError):  # torch's checks raise one or the other (TORCH_CHECK / TORCH_CHECK_INDEX)
        return True
    return False


def replicated_probe_args(kernel: EmptyRejecting) -> tuple:
    """The probe's arguments with each tensor as a replicated DTensorSpec on a probe mesh and its empty dims of size
    1 (what sharding propagation needs to trace the op)."""
    return tuple(
        _compat.probe_spec(a.new_zeros([max(size, 1) for size in a.shape]), (Replicate(),))
        if isinstance(a, torch.Tensor) else a
        for a in kernel.probe_args()
    )


def _decomposition_shards(op, kernel: EmptyRejecting) -> bool:
    """The feature check for an op torch shards only through its decomposition fallback: whether that fallback
    finds a strategy for the probe's call (2.11's finds none for batch norm, 2.12's does, and then runs the op's own
    kernel on every rank's shard)."""
    return _compat.propagates(op, replicated_probe_args(kernel))


def starves_a_rank(spec: DTensorSpec, dims: tuple[int, ...]) -> bool:
    """Whether some rank would hold an empty shard of one of `dims` of a non-empty tensor placed as `spec`."""
    shape = tuple(spec.tensor_meta.shape)
    if 0 in shape or not any(getattr(p, "dim", None) in dims for p in spec.placements):
        return False  # nothing of `dims` is sharded, or the tensor is empty on one device too: nothing to choose
    return any(local[d] == 0 for local in _compat.local_shapes(shape, spec.mesh.shape, spec.placements) for d in dims)


def _runnable(offered: OpStrategy, dims: tuple[int, ...]) -> OpStrategy:
    return OpStrategy([s for s in offered.strategies if not starves_a_rank(input_spec(s, 0), dims)])


def feeds_every_rank(guarded_dims: GuardedDims) -> Callable[[OpSchema], Callable[[OpSpec], bool]]:
    """For `filtered_single_dim`: keep the layouts whose first input leaves no rank an empty shard of a guarded dim."""

    def keeps(op_schema: OpSchema) -> Callable[[OpSpec], bool]:
        dims = guarded_dims(op_schema)
        return lambda spec: not starves_a_rank(input_spec(spec, 0), dims)

    return keeps


def _unstarved(spec: DTensorSpec, dims: tuple[int, ...]) -> DTensorSpec:
    """`spec` with its shards of `dims` replicated, innermost mesh dim first, until no rank is starved."""
    placements = list(spec.placements)
    for mesh_dim in reversed(range(len(placements))):
        if not starves_a_rank(DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta), dims):
            break
        if getattr(placements[mesh_dim], "dim", None) in dims:
            placements[mesh_dim] = Replicate()
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def runnable_op_strategy(torch_strategy: Callable, guarded_dims: GuardedDims) -> Callable:
    """torch's op_strategy function without the layouts that starve a rank.

    torch's reduction strategies follow the input's own layout only; where that starves a rank, they are asked
    again for the input moved to the nearest layout that does not, priced as the move from where it is.
    """

    def strategy(op_schema: OpSchema) -> OpStrategy:
        offered = torch_strategy(op_schema)
        dims = guarded_dims(op_schema)
        runnable = _runnable(offered, dims)
        if len(runnable.strategies) == len(offered.strategies):
            return offered
        if runnable.strategies:
            return runnable
        target = _unstarved(op_schema.args_schema[0].strategies[0].output_spec, dims)
        return _runnable(strategy_for_moved_inputs(torch_strategy, op_schema, {0: target}), dims)

    return strategy


def unstarving_handler(handler: Callable, guarded_dims: GuardedDims) -> Callable:
    """torch's custom dispatch handler for an op, run on an input first moved off any layout that starves a rank.

    Such handlers (argmax/argmin) compute on the input's own local pieces, so no strategy can steer them.
    """

    def handle(op_call, args, kwargs):
        source = args[0]
        dims = guarded_dims(OpSchema(op_call, (source._spec, *args[1:]), kwargs))
        if starves_a_rank(source._spec, dims):
            target = _unstarved(source._spec, dims)
            args = (source.redistribute(source.device_mesh, target.placements), *args[1:])
        return handler(op_call, args, kwargs)

    return handle


def _steer(op, kernel: EmptyRejecting) -> Undo | None:
    handler = _compat.custom_op_handler(op)
    if handler is not None:  # it runs in place of DTensor's propagate-redistribute-compute path
        return swap_handlers({op: unstarving_handler(handler, kernel.guarded_dims)})
    kind = _compat.torch_strategy_kind(op)
    if kind == "single_dim":
        keeps = feeds_every_rank(kernel.guarded_dims)
        return single_dim_as_op_strategy(op, lambda rule: filtered_single_dim(rule, keeps))
    if kind == "op_strategy":
        return wrap_strategies([op], lambda torch_strategy: runnable_op_strategy(torch_strategy, kernel.guarded_dims))
    return None  # torch does not shard the op itself, or only through its decomposition fallback (steered apart)


def _steer_decompositions(steered: dict) -> Undo:
    """torch's decomposition fallback without the layouts that starve a rank, for the ops in `steered` (op ->
    EmptyRejecting). The fallback offers every layout its trace allows, all-Replicate included, so dropping the
    starving ones always leaves one that runs."""

    def wrap(torch_strategy: Callable) -> Callable:
        def strategy(op_schema: OpSchema) -> OpStrategy | None:
            offered = torch_strategy(op_schema)
            kernel = steered.get(op_schema.op)
            if offered is None or kernel is None:
                return offered
            return _runnable(offered, kernel.guarded_dims(op_schema))

        return strategy

    return _compat.wrap_decomposition_strategy(wrap)


@torch_fix(
    "layouts with empty shards the kernel rejects",
    ops=(
        "aten::_fft_c2c.default", "aten::_fft_r2c.default", "aten::_fft_c2r.default",
        "aten::native_batch_norm.default", "aten::_native_batch_norm_legit.default",
        "aten::_native_batch_norm_legit.no_stats", "aten::_batch_norm_with_update.default",
        "aten::avg_pool1d.default", "aten::max_pool1d_with_indices.default", "aten::max_pool2d_with_indices.default",
        "aten::max_pool2d_with_indices_backward.default", "aten::max_pool3d_with_indices.default",
        "aten::avg_pool2d.default", "aten::avg_pool3d.default", "aten::adaptive_max_pool2d.default",
        "aten::adaptive_max_pool3d.default", "aten::_adaptive_avg_pool3d.default",
        "aten::max.default", "aten::min.default", "aten::amax.default", "aten::amin.default",
        "aten::aminmax.default", "aten::argmax.default", "aten::argmin.default",
        "aten::linalg_vector_norm.default", "aten::norm.Scalar",
    ),
    why="torch keeps layouts where a rank holds an empty shard (5 over 4 ranks: 2,2,1,0) and the CPU kernel "
    "(MKL FFT before 2.15, batch norm training, pooling of empty channels, max/min/amax/amin/aminmax/argmax/argmin, "
    "inf/negative norms) raises on the empty input",
)
def fix_empty_shards():
    rejecting = {op: kernel for op, kernel in kernels().items() if rejects_empty_input(op, kernel)}
    steered = {op: undo for op, kernel in rejecting.items() if (undo := _steer(op, kernel)) is not None}
    through_decomposition = {
        op: kernel for op, kernel in rejecting.items()
        if _compat.torch_strategy_kind(op) == "decomposition" and _decomposition_shards(op, kernel)
    }
    if through_decomposition:
        steered.update(dict.fromkeys(through_decomposition, _steer_decompositions(through_decomposition)))
    undos = list(dict.fromkeys(steered.values()))  # the decomposition steer is one undo for all its ops
    return applied_to(list(steered), undo_all(undos)) if steered else None
