"""`segment_reduce` and its backward on DTensors: a dispatch handler, because no rule can move keyword tensors.

The segment boundaries come as keyword-only tensors (`lengths=` or `offsets=`), and DTensor's dispatch
redistributes positional tensors only: a strategy asking for `lengths` on another layout would run the kernel on
the unmoved pieces, a WRONG result. torch 2.13 has no strategy, so the ops fail ("does not have a sharding
strategy registered"). The handler moves every tensor itself.

Layout: the op reduces runs along `axis` independently for every other index. Per mesh dim, data sharded on a dim
d other than the axis stays sharded; the boundaries carry the dims before the axis (shape `data.shape[:axis] +
(segments,)`), so for d < axis they are sharded on d alike, and for d > axis they stay whole. Data sharded on the
axis, or Partial, is replicated (Partial would pass for sum only without an `initial` value). The CPU kernel
rejects an empty shard of a dim before the axis, so such layouts are replicated as well.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, Replicate, Shard
from dtensor_ext.torch_fixes import swap_handlers, torch_fix

aten = torch.ops.aten

_BOUNDARIES = ("lengths", "indices", "offsets")


def _placements_for(data: DTensor, axis: int) -> tuple[list, list]:
    """(data placements, boundary placements) the op runs on without communication."""
    keep = [p if isinstance(p, Shard) and p.dim != axis else Replicate() for p in data.placements]
    pieces = _compat.local_shapes(data.shape, data.device_mesh.shape, keep)
    if any(piece[d] == 0 for piece in pieces for d in range(axis)):
        keep = [Replicate() if isinstance(p, Shard) and p.dim < axis else p for p in keep]
    boundaries = [p if isinstance(p, Shard) and p.dim < axis else Replicate() for p in keep]
    return keep, boundaries


def _as_dtensor(name: str, value: object) -> DTensor:
    if isinstance(value, DTensor):
        return value
    if isinstance(value, torch.Tensor):
        raise RuntimeError(f"segment_reduce: {name}= is a torch.Tensor and the data a DTensor; pass {name} as a "
                           "DTensor (DTensor refuses mixed inputs)")
    raise TypeError(f"segment_reduce: {name}= must be a tensor, got {type(value).__name__}")


def _moved_local(t: DTensor, placements: list) -> torch.Tensor:
    """`t`'s local tensor moved to `placements` the way DTensor's dispatch moves inputs (a handler runs below
    autograd: `DTensor.redistribute` there is an autograd function, which torch 2.11 follows with an in-place detach
    that has no strategy)."""
    target = DTensorSpec(t.device_mesh, tuple(placements), tensor_meta=t._spec.tensor_meta)
    return _compat.dispatch_redistributor()(t._local_tensor, t._spec, target)


def _segment_handler(data_args: int):
    """Handler for an op whose first `data_args` positional tensors are laid out like the data (the backward's
    grad and output too: they differ from the data on the axis only)."""

    def handle(op_call, args, kwargs):
        tensors, rest = args[:data_args], args[data_args:]
        data = tensors[-1]
        if not isinstance(data, DTensor):
            raise TypeError(f"{op_call}: expected DTensor inputs, got {type(data).__name__} data")
        axis = kwargs.get("axis", 0) % data.ndim
        mesh = data.device_mesh
        data_placements, boundary_placements = _placements_for(data, axis)
        local_args = [_moved_local(t, data_placements) for t in tensors]
        local_kwargs = dict(kwargs)
        for name in _BOUNDARIES:
            if kwargs.get(name) is not None:
                local_kwargs[name] = _moved_local(_as_dtensor(name, kwargs[name]), boundary_placements)
        local = op_call(*local_args, *rest, **local_kwargs)
        shape = list(data.shape)
        shape[axis] = local.shape[axis]  # the number of segments (the backward: the data's own axis length)
        meta = _compat.tensor_meta(torch.empty(shape, dtype=local.dtype, device="meta"))
        return _compat.wrap_local_results(local, DTensorSpec(mesh, tuple(data_placements), tensor_meta=meta))

    return handle


@functools.cache
def _torch_refuses_segments(op) -> bool:
    """Feature check: torch's propagation of `op` on a replicated [2, 2] data tensor with replicated `lengths=`
    (one segment of 2 along axis 0) on a 2-rank probe mesh finds no strategy."""
    data, reduced = torch.zeros(2, 2), torch.zeros(1, 2)
    replicated = {name: _compat.probe_spec(t, (Replicate(),))
                  for name, t in (("data", data), ("reduced", reduced), ("lengths", torch.tensor([2])))}
    if op is aten.segment_reduce.default:
        args = (replicated["data"], "sum")
    else:  # grad and output have the reduced shape
        args = (replicated["reduced"], replicated["reduced"], replicated["data"], "sum")
    return not _compat.propagates(op, args, {"lengths": replicated["lengths"]})


@torch_fix(
    "segment_reduce keyword tensors",
    ops=("aten::segment_reduce.default", "aten::_segment_reduce_backward.default"),
    why="no strategy (fails on every layout), and a rule cannot help: DTensor never moves keyword tensors such as "
    "lengths=/offsets=",
)
def fix_segment_reduce():
    handlers = {
        aten.segment_reduce.default: _segment_handler(1),
        aten._segment_reduce_backward.default: _segment_handler(3),
    }
    ours = {
        op: handler
        for op, handler in handlers.items()
        if _compat.custom_op_handler(op) is None and _torch_refuses_segments(op)
    }
    if not ours:
        return None
    return swap_handlers(ours)
