"""How a plan's gradients travel back, the one description the solve prices, the plan lists and the executor runs.

A reader's gradient goes back to the value it read at the value's own placements (a Partial value's as Replicate),
except on the mesh dims where the reader's backward leaves it Partial: there it stays Partial, so that autograd
sums the Partial gradients of all the value's readers first and the sum is reduced once, where the value was made,
straight into the value's placement: a reduce-scatter into a Shard, an all-reduce into a Replicate. DTensor's own
redistribute backward would reduce each moved reader's gradient on its own (three reduce-scatters where q, k and v
read one sequence-sharded value), so the executor's moves carry their gradients back this way instead.

Where a value's readers send gradients Partial on different mesh dims, or some Partial and some not, autograd
would meet a Partial sum with a whole one, and DTensor's add would reduce the Partial part there, once per such
meeting. Those readers are grouped by the mesh dims their gradients are Partial on, each group reads the value
through its own step (`read_in_group`), and that step's backward reduces the group's summed gradient once: the
groups' gradients then meet whole.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dtensor_ext._compat import called_in_graph
from dtensor_ext.policy.trace import last_writes

__all__ = ["gradient_brought", "gradient_move", "gradient_target", "move_for_reading", "partial_groups",
           "read_in_group", "reduce_partial_gradient", "reduction_stops"]


def _whole(p):
    """A value's gradient placement where the value is `p`: a Partial value's gradient is whole (Replicate)."""
    return Replicate() if p.is_partial() else p


def gradient_target(held: tuple, g: tuple) -> tuple:
    """Where a reader's gradient `g` goes back to for a value held at `held`: the value's placements, a Partial
    value's as Replicate, except the mesh dims where `g` is Partial, which stay Partial for the one reduction."""
    return tuple(x if x.is_partial() else _whole(h) for x, h in zip(g, held))


def gradient_move(held: tuple, g: tuple) -> tuple[tuple, tuple]:
    """The (from, to) the edge's price covers for that gradient: `gradient_target`'s move with the Partial mesh
    dims left out (they are priced by the value's reduction, `reduction_stops`), so the two never count twice."""
    back_to = tuple(_whole(h) for h in held)
    return tuple(b if x.is_partial() else x for x, b in zip(g, back_to)), back_to


def reduction_stops(held: tuple, partial_dims) -> list[tuple]:
    """The placements the summed gradient of a value held at `held` passes through when it is Partial on
    `partial_dims` and the rest is at the value's placements: straight into the value's placement, except where
    that is a shard DTensor cannot reduce-scatter into (a _StridedShard): there all-reduced first, then cut."""
    whole = tuple(_whole(p) for p in held)
    start = tuple(Partial() if d in partial_dims else p for d, p in enumerate(whole))
    if all(type(whole[d]) is Shard or whole[d].is_replicate() for d in partial_dims):
        return [start, whole]
    reduced = tuple(Replicate() if d in partial_dims else p for d, p in enumerate(whole))
    return [start, reduced] if reduced == whole else [start, reduced, whole]


@called_in_graph  # it decides by the gradient's placements: under torch.compile, by the real ones (see _compat)
def reduce_partial_gradient(grad: DTensor, placements) -> DTensor:
    """`grad`, Partial on some mesh dims, at `placements` (the value's own) by `reduction_stops`' route."""
    partial_dims = {d for d, p in enumerate(grad.placements) if p.is_partial()}
    if not partial_dims:
        return grad if tuple(grad.placements) == tuple(placements) else grad.redistribute(grad.device_mesh,
                                                                                          placements)
    for stop in reduction_stops(tuple(placements), partial_dims)[1:]:
        if tuple(grad.placements) != stop:
            grad = grad.redistribute(grad.device_mesh, list(stop))
    return grad


class _Move(torch.autograd.Function):
    """A redistribution whose backward keeps the gradient's Partial mesh dims Partial (`gradient_target`)."""

    @staticmethod
    def forward(ctx, value: DTensor, target: tuple):
        ctx.held = tuple(value.placements)
        return value.redistribute(value.device_mesh, list(target))

    @staticmethod
    def backward(ctx, grad):
        return (_gradient_back(grad, ctx.held) if isinstance(grad, DTensor) else grad), None


@called_in_graph  # it decides by the gradient's placements: under torch.compile, by the real ones (see _compat)
def _gradient_back(grad: DTensor, held: tuple) -> DTensor:
    back = gradient_target(held, tuple(grad.placements))
    return grad if tuple(grad.placements) == back else grad.redistribute(grad.device_mesh, list(back))


def move_for_reading(value: DTensor, target) -> DTensor:
    """`value` redistributed to `target` for one reader, its gradient carried back by `gradient_target`."""
    return _Move.apply(value, tuple(target))


def partial_groups(plan) -> dict[int, tuple[dict[frozenset, list[tuple[int, int]]], bool]]:
    """Per floating value that some chosen reader sends a Partial gradient: its reads (op, operand slot) by the
    set of mesh dims their gradients are Partial on (the empty set: whole gradients), in reading order, and whether
    the readers are grouped by those sets (`read_in_group`): where they differ, or some readers send a whole
    gradient beside a Partial one. Not where the value is Partial itself, or its memory is written in place (a
    group's step is a view: autograd refuses an in-place write through it)."""
    reads: dict[int, dict[frozenset, list[tuple[int, int]]]] = {}
    for op in plan.ops:
        for slot, tid in enumerate(op.node.operand_ids):
            g = op.grads[slot] if slot < len(op.grads) else None
            if g is not None:
                dims = frozenset(m for m, x in enumerate(g) if x.is_partial())
                reads.setdefault(tid, {}).setdefault(dims, []).append((op.node.index, slot))
    written = last_writes(plan.graph)
    return {tid: (by_dims, len(by_dims) > 1 and plan.graph.storage(tid) not in written
                  and not any(p.is_partial() for p in plan.held(tid)))
            for tid, by_dims in reads.items()
            if any(by_dims) and plan.graph.tensors[tid].is_floating_point()}


class _GradientBrought(torch.autograd.Function):
    """The value itself (a view); backward hands the gradient summed over this view's readers to
    `bring(grad, placements)` (not a tensor hook on the value, which would break torch.compile's graph). `bring`
    decides by the gradient's placements, so under torch.compile it must be `called_in_graph`: dynamo traces this
    backward with a gradient placed like the value, and would bake that guess into the graph."""

    @staticmethod
    def forward(ctx, value: DTensor, placements: tuple, bring):
        ctx.placements, ctx.bring = placements, bring
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return (ctx.bring(grad, ctx.placements) if isinstance(grad, DTensor) else grad), None, None


def gradient_brought(value: DTensor, placements: tuple, bring) -> DTensor:
    """`value` for some readers, whose summed gradient `bring(grad, placements)` returns as it goes back."""
    return _GradientBrought.apply(value, tuple(placements), bring)


def read_in_group(value: DTensor, held) -> DTensor:
    """`value` for the readers of one group (`partial_groups`): their gradients are summed, then reduced once."""
    return gradient_brought(value, held, reduce_partial_gradient)
