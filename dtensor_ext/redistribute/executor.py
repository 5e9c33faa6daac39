"""Running a plan on real DTensors with functional collectives, and `redistribute` with autograd.

Data-moving steps pack each rank's outgoing pieces into one buffer and run one `all_to_all_single` with
per-rank split sizes over the mesh's ranks (ranks outside a step's mesh dims exchange nothing), so the bytes on
the wire are exactly the plan's. Reductions run on the mesh dim's process group (`all_reduce`,
`reduce_scatter_tensor`), or, for a reduce_exchange, as two such all-to-alls with a local reduction between. Under a simulated mesh every rank's part is computed in this process.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtensor_ext._compat import (
    LocalTensor,
    Partial,
    Replicate,
    enabled_local_tensor_mode,
    funcol,
    local_int,
    local_tensor_values,
)
from dtensor_ext.redistribute.layout import Layout, coordinates
from dtensor_ext.redistribute.plan import Plan, Step, Transfer

__all__ = ["execute", "redistribute"]


def _per_rank(fn, *tensors):
    """fn(mesh_rank_index, *that rank's tensors) on every simulated rank, or on this process's rank."""
    tensors = [t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t for t in tensors]
    mode = enabled_local_tensor_mode()
    if mode is None:
        return fn(dist.get_rank(), *tensors)
    with mode.disable():
        return LocalTensor({r: fn(r, *[local_tensor_values(t)[r] for t in tensors]) for r in sorted(mode.ranks)})


def _rank_ints(values: list[int]):
    mode = enabled_local_tensor_mode()
    if mode is None:
        return values[dist.get_rank()]
    return local_int({r: values[r] for r in mode.ranks})


def _positions(held, wanted) -> list[slice | torch.Tensor]:
    """Per dim: where the `wanted` global indices sit inside a local tensor holding `held` (a slice if contiguous)."""
    out = []
    for held_dim, wanted_dim in zip(held, wanted):
        ranges, base = [], 0
        for a, b in held_dim:
            for lo, hi in wanted_dim:
                if lo < b and hi > a:
                    ranges.append((max(lo, a) - a + base, min(hi, b) - a + base))
            base += b - a
        if len(ranges) <= 1:
            out.append(slice(*ranges[0]) if ranges else slice(0, 0))
        else:
            out.append(torch.cat([torch.arange(lo, hi) for lo, hi in ranges]))
    return out


def _select(t: torch.Tensor, positions) -> torch.Tensor:
    for dim, index in enumerate(positions):
        t = t[(slice(None),) * dim + (index,)] if isinstance(index, slice) else t.index_select(dim, index)
    return t


def _assign(out: torch.Tensor, positions, value: torch.Tensor) -> None:
    if all(isinstance(p, slice) for p in positions):
        out[tuple(positions)] = value
        return
    as_index = [torch.arange(p.start, p.stop) if isinstance(p, slice) else p for p in positions]
    out[torch.meshgrid(*as_index, indexing="ij")] = value


def _check_mesh(mesh, plan: Plan) -> None:
    if tuple(mesh.shape) != plan.mesh_shape:
        raise ValueError(f"plan for mesh {plan.mesh_shape} given a mesh of shape {tuple(mesh.shape)}")
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(dist.get_world_size())):
        raise ValueError(f"the executor needs a mesh over all ranks in order 0..{dist.get_world_size() - 1}, got {ranks}")


def _all_to_all(transfers, world: int, pack, *local):
    """One all_to_all_single carrying `transfers`; pack(rank, *that rank's tensors, its outgoing transfers in
    destination order) gives the tensors it sends. Returns the received buffer (pieces in source order)."""
    sizes = [[0] * world for _ in range(world)]
    for t in transfers:
        sizes[t.src][t.dst] += _numel(t.block)
    outgoing = {r: sorted((t for t in transfers if t.src == r), key=lambda t: t.dst) for r in range(world)}

    def flat(r, *xs):
        parts = [p.reshape(-1) for p in pack(r, *xs, outgoing[r])]
        return torch.cat(parts) if parts else xs[0].new_zeros(0)

    return funcol.all_to_all_single(
        _per_rank(flat, *local),
        [_rank_ints([sizes[src][dst] for dst in range(world)]) for src in range(world)],
        [_rank_ints([sizes[src][dst] for src in range(world)]) for dst in range(world)],
        dist.group.WORLD,
    )


def _received(transfers, rank: int, buffer: torch.Tensor):
    """(transfer, its tensor) for each piece `rank` received, in the order `_all_to_all` laid them out."""
    offset = 0
    for t in sorted((t for t in transfers if t.dst == rank), key=lambda t: t.src):
        shape = [sum(b - a for a, b in d) for d in t.block]
        yield t, buffer[offset : offset + math.prod(shape)].reshape(shape)
        offset += math.prod(shape)


def _numel(block) -> int:
    return math.prod(sum(b - a for a, b in d) for d in block)


def _picker(before: Layout):
    """pack function for `_all_to_all`: each outgoing transfer's elements cut from the sender's local tensor."""
    return lambda r, x, outgoing: [_select(x, _positions(before.blocks[r], t.block)) for t in outgoing]


def _exchange(local, step: Step, before: Layout, after: Layout, world: int):
    def unpack(r, x, received=None):
        out = x.new_zeros(after.local_shapes[r])
        kept = after.overlap(r, before, r)
        if _numel(kept):
            _assign(out, _positions(after.blocks[r], kept), _select(x, _positions(before.blocks[r], kept)))
        if received is not None:
            for t, piece in _received(step.transfers, r, received):
                _assign(out, _positions(after.blocks[r], t.block), piece)
        return _zero_new_partials(r, out, step, before)

    if not step.transfers:
        return _per_rank(unpack, local)
    return _per_rank(unpack, local, _all_to_all(step.transfers, world, _picker(before), local))


def _reduce_exchange(local, step: Step, before: Layout, after: Layout, world: int):
    """Partial pieces to the merging ranks, a local reduction there, the results to the ranks that need them."""
    gather = [Transfer(src, m.rank, m.block) for m in step.merges for src in m.sources]
    reduce_op = next(p.reduce_op for p, q in zip(step.before, step.after) if isinstance(p, Partial) and p != q)

    def merge(r, x, pieces) -> torch.Tensor:
        """The reduced values of every block rank r merges, flattened one after another in merge order."""
        parts = {m.block: [_select(x, _positions(before.blocks[r], m.block))] for m in step.merges if m.rank == r}
        for t, piece in _received(gather, r, pieces):
            parts[t.block].append(piece)
        flat = [_combine(values, reduce_op).reshape(-1) for values in parts.values()]
        return torch.cat(flat) if flat else x.new_zeros(0)

    def values(r, flat) -> dict:
        """block -> its reduced value at rank r, as views into `merge`'s output."""
        out, offset = {}, 0
        for m in step.merges:
            if m.rank == r:
                shape = [sum(b - a for a, b in d) for d in m.block]
                out[m.block] = flat[offset : offset + math.prod(shape)].reshape(shape)
                offset += math.prod(shape)
        return out

    pieces = _all_to_all(gather, world, _picker(before), local) if gather else _per_rank(lambda r, x: x.new_zeros(0), local)
    reduced = _per_rank(merge, local, pieces)

    def unpack(r, flat, received=None):
        out = flat.new_zeros(after.local_shapes[r])
        mine = values(r, flat)
        for m in step.merges:
            if m.rank == r and m.keeps:
                _assign(out, _positions(after.blocks[r], m.block), mine[m.block])
        if received is not None:
            for t, piece in _received(step.transfers, r, received):
                _assign(out, _positions(after.blocks[r], t.block), piece)
        return out

    if not step.transfers:
        return _per_rank(unpack, reduced)
    results = lambda r, flat, outgoing: [values(r, flat)[t.block] for t in outgoing]
    return _per_rank(unpack, reduced, _all_to_all(step.transfers, world, results, reduced))


def _combine(values: list[torch.Tensor], reduce_op: str) -> torch.Tensor:
    stacked = torch.stack(values)
    if reduce_op in ("sum", "avg"):
        total = stacked.sum(0)
        return total / len(values) if reduce_op == "avg" else total
    return stacked.amax(0) if reduce_op == "max" else stacked.amin(0)


def _zero_new_partials(rank: int, out: torch.Tensor, step: Step, before: Layout) -> torch.Tensor:
    """Replicate -> Partial(sum): one rank per group keeps the value, the others hold zeros."""
    coord = coordinates(before.mesh_shape)[rank]
    for j, (p, q) in enumerate(zip(step.before, step.after)):
        if isinstance(q, Partial) and isinstance(p, Replicate) and q.reduce_op == "sum" and coord[j] != 0:
            return torch.zeros_like(out)
    return out


def _all_reduce(local, step: Step, mesh):
    mesh_dim = step.mesh_dims[0]
    reduce_op = step.before[mesh_dim].reduce_op
    out = funcol.all_reduce(local, "sum" if reduce_op == "avg" else reduce_op, (mesh, mesh_dim))
    return out / mesh.size(mesh_dim) if reduce_op == "avg" else out


def _reduce_scatter(local, step: Step, mesh, before: Layout, after: Layout):
    mesh_dim, dim = step.mesh_dims[0], step.tensor_dim
    n = mesh.size(mesh_dim)
    reduce_op = step.before[mesh_dim].reduce_op

    def pad(r, x):
        chunk = -(-x.size(dim) // n)
        padded = torch.nn.functional.pad(x.movedim(dim, 0), [0, 0] * (x.dim() - 1) + [0, chunk * n - x.size(dim)])
        return padded.contiguous()

    padded = _per_rank(pad, local)
    out = funcol.reduce_scatter_tensor(padded, "sum" if reduce_op == "avg" else reduce_op, 0, (mesh, mesh_dim))
    if reduce_op == "avg":
        out = out / n

    def unpad(r, x):
        return x.narrow(0, 0, after.local_shapes[r][dim]).movedim(0, dim).contiguous()

    return _per_rank(unpad, out)


def execute(tensor: DTensor, plan: Plan) -> DTensor:
    """Run `plan` on `tensor` (which must match its shape, dtype and source placements)."""
    mesh = tensor.device_mesh
    if tuple(tensor.shape) != plan.shape or tuple(tensor.placements) != plan.src or tensor.dtype != plan.dtype:
        raise ValueError(
            f"plan for {plan.shape} {plan.dtype} {plan.src} given a tensor {tuple(tensor.shape)} {tensor.dtype} "
            f"{tuple(tensor.placements)}"
        )
    if plan.planner == "dtensor":
        raise ValueError("the 'dtensor' plan is a record of torch's own redistribute; run DTensor.redistribute")
    _check_mesh(mesh, plan)
    local = tensor._local_tensor
    world = math.prod(plan.mesh_shape)
    for step in plan.steps:
        before, after = Layout(plan.shape, plan.mesh_shape, step.before), Layout(plan.shape, plan.mesh_shape, step.after)
        if step.kind == "all_reduce":
            local = _all_reduce(local, step, mesh)
        elif step.kind == "reduce_scatter":
            local = _reduce_scatter(local, step, mesh, before, after)
        elif step.kind == "reduce_exchange":
            local = _reduce_exchange(local, step, before, after, world)
        else:
            local = _exchange(local, step, before, after, world)
    if isinstance(local, funcol.AsyncCollectiveTensor):
        local = local.wait()
    return DTensor.from_local(local, mesh, plan.dst, run_check=False, shape=tensor.shape, stride=tensor.stride())


@functools.lru_cache(maxsize=256)
def _cached_plan(shape, mesh_shape, src, dst, dtype, options) -> Plan:
    """Planning is pure in its arguments; a training loop redistributes the same way every step."""
    from dtensor_ext.redistribute.planners import plan

    return plan(shape, mesh_shape, src, dst, dtype=dtype, **dict(options))


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: DTensor, placements, options):
        ctx.source, ctx.options = tuple(tensor.placements), options
        key = (tuple(tensor.shape), tuple(tensor.device_mesh.shape), ctx.source, placements, tensor.dtype)
        return execute(tensor, _cached_plan(*key, tuple(sorted(options.items()))))

    @staticmethod
    def backward(ctx, grad: DTensor):
        # the gradient of a Partial input is the full gradient on every rank of that mesh dim
        target = tuple(Replicate() if isinstance(p, Partial) else p for p in ctx.source)
        return redistribute(grad, target, **ctx.options), None, None


def redistribute(tensor: DTensor, placements, *, planner: str = "optimal", **plan_options) -> DTensor:
    """`tensor.redistribute(mesh, placements)` along the chosen planner's plan; differentiable."""
    if planner == "dtensor":
        return tensor.redistribute(tensor.device_mesh, tuple(placements))
    return _Redistribute.apply(tensor, tuple(placements), dict(plan_options, planner=planner))
