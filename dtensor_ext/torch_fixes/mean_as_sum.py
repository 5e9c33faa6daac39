"""Means over a sharded batch: a local sum scaled by the global count, instead of gathering.

A mean divides by how many elements there are in all; one shard's mean divides by its own count, so the package's
loss rules leave a mean-reduced loss whole (the inputs are gathered in forward and backward) and torch's `mean`
gathers an unevenly sharded input. The exact local answer exists: the sum of the local elements divided by the
global count is a `Partial(sum)` piece of the mean, and the backward of a mean is the backward of a sum fed with
`grad / count`, which is elementwise. These handlers rewrite exactly those calls (a mean with a sharded input) into
the summed op, scaled; every other call runs DTensor's generic path unchanged.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, Partial
from dtensor_ext.rules.pointwise import (
    _LOSS_BACKWARD_REDUCTION_ARG, _LOSS_REDUCTION_ARG, _SAMPLE_LOSS_BACKWARD_REDUCTION_ARG, MEAN, SUM,
)
from dtensor_ext.torch_fixes import generic_dispatch, swap_handlers, torch_fix

aten = torch.ops.aten

# loss op -> where its reduction argument sits (forward losses return one tensor; multilabel's returns two)
_FORWARD = {**_LOSS_REDUCTION_ARG, "aten::multi_margin_loss": 5}
_BACKWARD = {**_LOSS_BACKWARD_REDUCTION_ARG, "aten::multi_margin_loss_backward":
             _SAMPLE_LOSS_BACKWARD_REDUCTION_ARG["aten::multi_margin_loss_backward"]}
_PER_SAMPLE = ("aten::multi_margin_loss", "aten::multi_margin_loss_backward")  # a mean over rows, not elements


def _sharded(args) -> bool:
    return any(isinstance(a, DTensor) and any(p.is_shard() for p in a.placements) for a in args)


def _with_reduction(args, kwargs, position, reduction) -> tuple[tuple, dict]:
    if len(args) > position:
        return args[:position] + (reduction,) + args[position + 1:], kwargs
    return args, {**kwargs, "reduction": reduction}


def _reduction_of(args, kwargs, position) -> int:
    return args[position] if len(args) > position else kwargs.get("reduction", MEAN)


def _count(op_name: str, self: DTensor, other: torch.Tensor) -> int:
    if op_name in _PER_SAMPLE:
        return self.shape[0] if self.ndim == 2 else 1
    return math.prod(torch.broadcast_shapes(self.shape, other.shape))


def mean_loss_as_scaled_sum(op_call, args, kwargs):
    position = _FORWARD[op_call.name()]
    if _reduction_of(args, kwargs, position) != MEAN or not _sharded(args):
        return generic_dispatch(op_call, args, kwargs)
    sum_args, sum_kwargs = _with_reduction(args, kwargs, position, SUM)
    summed = op_call(*sum_args, **sum_kwargs)
    return summed / _count(op_call.name(), args[0], args[1])


def mean_loss_backward_as_sum_backward(op_call, args, kwargs):
    position = _BACKWARD[op_call.name()]
    if _reduction_of(args, kwargs, position) != MEAN or not _sharded(args):
        return generic_dispatch(op_call, args, kwargs)
    (grad, *rest), sum_kwargs = _with_reduction(args, kwargs, position, SUM)
    return op_call(grad / _count(op_call.name(), args[1], args[2]), *rest, **sum_kwargs)


def _unevenly_sharded_on(self: DTensor, dims) -> bool:
    mesh = self.device_mesh
    return any(
        p.is_shard() and p.dim in dims and self.shape[p.dim] % mesh.size(m) for m, p in enumerate(self.placements)
    )


def _as_partial_avg(summed_piece: DTensor) -> DTensor:
    """The same value with each Partial(sum) mesh dim made Partial(avg) (pieces scaled by that dim's size): what
    torch's even `mean` returns, and what an in-place shift such as rms_norm's `add_(eps)` keeps."""
    mesh, placements = summed_piece.device_mesh, summed_piece.placements
    summed_dims = [m for m, p in enumerate(placements) if p.is_partial() and p.reduce_op == "sum"]
    avg = tuple(Partial("avg") if m in summed_dims else p for m, p in enumerate(placements))
    spec = DTensorSpec(mesh, avg, tensor_meta=summed_piece._spec.tensor_meta)
    scale = math.prod(mesh.size(m) for m in summed_dims)
    return _compat.wrap_local_results(summed_piece._local_tensor * scale, spec)


def mean_as_scaled_sum(op_call, args, kwargs):
    """torch's `mean` keeps Partial(avg) for even shards (no communication) and gathers uneven ones; there the
    local sum over the global count is exact, handed out as Partial(avg) like torch's even mean."""
    self = args[0]
    if self.ndim == 0:  # nothing to shard (and dim -1 / 0 names the tensor itself)
        return generic_dispatch(op_call, args, kwargs)
    dims = args[1] if op_call is aten.mean.dim and len(args) > 1 else kwargs.get("dim")
    dims = range(self.ndim) if dims is None or dims == [] else [d % self.ndim for d in dims]
    if not _unevenly_sharded_on(self, dims):
        return generic_dispatch(op_call, args, kwargs)
    keepdim = args[2] if op_call is aten.mean.dim and len(args) > 2 else kwargs.get("keepdim", False)
    summed = aten.sum.dim_IntList(self, list(dims), keepdim, dtype=kwargs.get("dtype"))
    return _as_partial_avg(summed / math.prod(self.shape[d] for d in dims))


def _ops(names) -> list:
    """The default overloads of "aten::name" ops the running torch has."""
    packets = [getattr(aten, name.removeprefix("aten::"), None) for name in names]
    return [p.default for p in packets if p is not None]


@torch_fix(
    "means gather where a scaled local sum is exact",
    ops=(*_FORWARD, *_BACKWARD, "aten::mean.default", "aten::mean.dim"),
    why="a mean-reduced loss over a sharded batch all-gathers its inputs in forward and backward, and a mean of "
    "an unevenly sharded tensor gathers it; the local sum over the global count is exact and needs none",
)
def fix_means():
    handlers = {op: mean_loss_as_scaled_sum for op in _ops(_FORWARD)}
    handlers |= {op: mean_loss_backward_as_sum_backward for op in _ops(_BACKWARD)}
    handlers |= {aten.mean.default: mean_as_scaled_sum, aten.mean.dim: mean_as_scaled_sum}
    free = {op: h for op, h in handlers.items() if _compat.custom_op_handler(op) is None}
    return swap_handlers(free) if free else None
