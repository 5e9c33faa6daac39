"""Running a plan on real DTensors with functional collectives, and `redistribute` with autograd.

Data-moving steps pack each rank's outgoing pieces into one buffer and run one `all_to_all_single` with
per-rank split sizes on the process group of the mesh dims the step spans (a flattened sub-mesh where it spans
several), so the bytes on the wire are exactly the plan's. Reductions run on the mesh dim's process group
(`all_reduce`, `reduce_scatter_tensor`), or, for a reduce_exchange, as two such all-to-alls with a local reduction
between. Ranks are numbered by their coordinate in the DTensor's mesh, so any DeviceMesh works (a sub-mesh,
non-contiguous rank orders). Under a simulated mesh every rank's part is computed in this process.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtensor_ext._compat import (
    LocalTensor,
    Partial,
    Replicate,
    enabled_local_tensor_mode,
    flattened_mesh,
    funcol,
    local_int,
    local_tensor_values,
    mesh_coordinates_by_rank,
)
from dtensor_ext.redistribute.placements import is_shard
from dtensor_ext.redistribute.layout import Layout, coordinates
from dtensor_ext.redistribute.plan import Plan, Step, Transfer

__all__ = ["execute", "redistribute"]


class _Ranks:
    """Where this process's rank(s) sit in the plan's mesh: global rank -> row-major index of its coordinate."""

    def __init__(self, mesh, mesh_shape):
        coords = mesh_coordinates_by_rank(mesh)
        self.simulated = enabled_local_tensor_mode() is not None  # asked once: per_rank disables the mode inside
        self.mesh, self.mesh_shape = mesh, tuple(mesh_shape)
        self.index = {r: _row_major(c, mesh_shape) for r, c in coords.items()}
        self.coords = coordinates(mesh_shape)

    def per_rank(self, fn, *tensors):
        """fn(mesh index, *that rank's tensors) on every simulated rank, or on this process's rank."""
        tensors = [t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t for t in tensors]
        if not self.simulated:
            (rank,) = self.index
            return fn(self.index[rank], *tensors)
        mode = enabled_local_tensor_mode()
        with mode.disable():
            return LocalTensor(
                {r: fn(self.index[r], *[local_tensor_values(t)[r] for t in tensors]) for r in sorted(mode.ranks)}
            )

    def ints(self, values_by_index):
        """One int per rank (values_by_index(mesh index)), as collectives take split sizes."""
        if not self.simulated:
            return values_by_index(next(iter(self.index.values())))
        return {r: values_by_index(i) for r, i in self.index.items()}

    def group(self, mesh_dims: tuple[int, ...]):
        """(process group argument, members of `index`'s group in group order) for a step over `mesh_dims`."""
        if len(mesh_dims) == 1:
            group = (self.mesh, mesh_dims[0])
        else:
            flat = flattened_mesh(self.mesh, mesh_dims)
            if flat is None:
                raise ValueError(
                    f"a step over mesh dims {mesh_dims} needs a flattened group, and torch flattens only meshes with "
                    "mesh_dim_names; name the mesh dims or plan with max_step_dims=1"
                )
            group = (flat, 0)
        if not self.simulated:
            # c10d numbers a group's ranks in global rank order, which differs from mesh coordinate order on
            # meshes with a non-contiguous rank layout
            index_of = {g: i for i, g in enumerate(self.mesh.mesh.flatten().tolist())}
            order = [index_of[g] for g in dist.get_process_group_ranks(group[0].get_group(group[1]))]
            return group, lambda index: order

        def members(index: int) -> list[int]:
            coord = self.coords[index]
            free = [range(n) if d in mesh_dims else (coord[d],) for d, n in enumerate(self.mesh_shape)]
            return [_row_major(c, self.mesh_shape) for c in itertools.product(*free)]

        return group, members


def _row_major(coord, mesh_shape) -> int:
    index = 0
    for c, n in zip(coord, mesh_shape):
        index = index * n + c
    return index


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


def _all_to_all(ranks: _Ranks, step: Step, transfers, pack, *local):
    """One all_to_all_single carrying `transfers` on the group of the step's mesh dims; pack(rank, *that rank's
    tensors, its outgoing transfers in destination order) gives the tensors it sends. Returns the received buffer
    (pieces in source order)."""
    sizes: dict[tuple[int, int], int] = {}
    for t in transfers:
        sizes[t.src, t.dst] = sizes.get((t.src, t.dst), 0) + _numel(t.block)
    group, members = ranks.group(step.mesh_dims)

    def flat(r, *xs):
        order = members(r)
        outgoing = sorted((t for t in transfers if t.src == r), key=lambda t: order.index(t.dst))
        parts = [p.reshape(-1) for p in pack(r, *xs, outgoing)]
        return torch.cat(parts) if parts else xs[0].new_zeros(0)

    def split_sizes(sending: bool) -> list:
        """Per group position: the elements each rank sends to (or receives from) the member there."""
        out = []
        for position in range(len(members(0))):
            def elements(i, position=position):
                peer = members(i)[position]
                return sizes.get((i, peer) if sending else (peer, i), 0)

            values = ranks.ints(elements)
            out.append(local_int(values) if isinstance(values, dict) else values)
        return out

    return funcol.all_to_all_single(ranks.per_rank(flat, *local), split_sizes(False), split_sizes(True), group)


def _received(transfers, rank: int, buffer: torch.Tensor, members):
    """(transfer, its tensor) for each piece `rank` received, in the order `_all_to_all` laid them out."""
    offset = 0
    order = members(rank)
    for t in sorted((t for t in transfers if t.dst == rank), key=lambda t: order.index(t.src)):
        shape = [sum(b - a for a, b in d) for d in t.block]
        yield t, buffer[offset : offset + math.prod(shape)].reshape(shape)
        offset += math.prod(shape)


def _numel(block) -> int:
    return math.prod(sum(b - a for a, b in d) for d in block)


def _picker(before: Layout):
    """pack function for `_all_to_all`: each outgoing transfer's elements cut from the sender's local tensor."""
    return lambda r, x, outgoing: [_select(x, _positions(before.blocks[r], t.block)) for t in outgoing]


def _exchange(ranks: _Ranks, local, step: Step, before: Layout, after: Layout):
    def unpack(r, x, received=None):
        out = x.new_zeros(after.local_shapes[r])
        kept = after.overlap(r, before, r)
        if _numel(kept):
            _assign(out, _positions(after.blocks[r], kept), _select(x, _positions(before.blocks[r], kept)))
        if received is not None:
            for t, piece in _received(step.transfers, r, received, ranks.group(step.mesh_dims)[1]):
                _assign(out, _positions(after.blocks[r], t.block), piece)
        return _zero_new_partials(r, out, step, before)

    if not step.transfers:
        return ranks.per_rank(unpack, local)
    return ranks.per_rank(unpack, local, _all_to_all(ranks, step, step.transfers, _picker(before), local))


def _reduce_exchange(ranks: _Ranks, local, step: Step, before: Layout, after: Layout):
    """Partial pieces to the merging ranks, a local reduction there, the results to the ranks that need them."""
    gather = [Transfer(src, m.rank, m.block) for m in step.merges for src in m.sources]
    reduce_op = next(p.reduce_op for p, q in zip(step.before, step.after) if isinstance(p, Partial) and p != q)

    def merge(r, x, pieces) -> torch.Tensor:
        """The reduced values of every block rank r merges, flattened one after another in merge order."""
        parts = {m.block: [_select(x, _positions(before.blocks[r], m.block))] for m in step.merges if m.rank == r}
        for t, piece in _received(gather, r, pieces, ranks.group(step.mesh_dims)[1]):
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

    pieces = _all_to_all(ranks, step, gather, _picker(before), local) if gather else ranks.per_rank(lambda r, x: x.new_zeros(0), local)
    reduced = ranks.per_rank(merge, local, pieces)

    def unpack(r, flat, received=None):
        out = flat.new_zeros(after.local_shapes[r])
        mine = values(r, flat)
        for m in step.merges:
            if m.rank == r and m.keeps:
                _assign(out, _positions(after.blocks[r], m.block), mine[m.block])
        if received is not None:
            for t, piece in _received(step.transfers, r, received, ranks.group(step.mesh_dims)[1]):
                _assign(out, _positions(after.blocks[r], t.block), piece)
        return out

    if not step.transfers:
        return ranks.per_rank(unpack, reduced)
    results = lambda r, flat, outgoing: [values(r, flat)[t.block] for t in outgoing]
    return ranks.per_rank(unpack, reduced, _all_to_all(ranks, step, step.transfers, results, reduced))


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


def _reduce_scatter(ranks: _Ranks, local, step: Step, mesh, before: Layout, after: Layout):
    mesh_dim, dim = step.mesh_dims[0], step.tensor_dim
    n = mesh.size(mesh_dim)
    reduce_op = step.before[mesh_dim].reduce_op

    def pad(r, x):
        chunk = -(-x.size(dim) // n)
        padded = torch.nn.functional.pad(x.movedim(dim, 0), [0, 0] * (x.dim() - 1) + [0, chunk * n - x.size(dim)])
        return padded.contiguous()

    padded = ranks.per_rank(pad, local)
    out = funcol.reduce_scatter_tensor(padded, "sum" if reduce_op == "avg" else reduce_op, 0, (mesh, mesh_dim))
    if reduce_op == "avg":
        out = out / n

    def unpad(r, x):
        return x.narrow(0, 0, after.local_shapes[r][dim]).movedim(0, dim).contiguous()

    return ranks.per_rank(unpad, out)


def execute(tensor: DTensor, plan: Plan) -> DTensor:
    """Run `plan` on `tensor` (which must match its shape, dtype and source placements)."""
    if tuple(tensor.shape) != plan.shape or tuple(tensor.placements) != plan.src or tensor.dtype != plan.dtype:
        raise ValueError(
            f"plan for {plan.shape} {plan.dtype} {plan.src} given a tensor {tuple(tensor.shape)} {tensor.dtype} "
            f"{tuple(tensor.placements)}"
        )
    local = execute_local(tensor._local_tensor, tensor.device_mesh, plan)
    return DTensor.from_local(local, tensor.device_mesh, plan.dst, run_check=False, shape=tensor.shape, stride=tensor.stride())


def execute_local(local: torch.Tensor, mesh, plan: Plan) -> torch.Tensor:
    """This rank's local tensor (every simulated rank's, under LocalTensorMode) after running `plan` on `mesh`."""
    if plan.planner == "dtensor":
        raise ValueError("the 'dtensor' plan is a record of torch's own redistribute; run DTensor.redistribute")
    if tuple(mesh.shape) != plan.mesh_shape:
        raise ValueError(f"plan for mesh {plan.mesh_shape} given a mesh of shape {tuple(mesh.shape)}")
    if not plan.steps:
        return local
    ranks = _Ranks(mesh, plan.mesh_shape)
    for step in plan.steps:
        before, after = Layout(plan.shape, plan.mesh_shape, step.before), Layout(plan.shape, plan.mesh_shape, step.after)
        if step.kind == "all_reduce":
            local = _all_reduce(local, step, mesh)
        elif step.kind == "reduce_scatter":
            local = _reduce_scatter(ranks, local, step, mesh, before, after)
        elif step.kind == "reduce_exchange":
            local = _reduce_exchange(ranks, local, step, before, after)
        else:
            local = _exchange(ranks, local, step, before, after)
    if isinstance(local, funcol.AsyncCollectiveTensor):
        local = local.wait()
    return local


@functools.lru_cache(maxsize=256)
def _cached_plan(shape, mesh_shape, src, dst, dtype, options) -> Plan:
    """Planning is pure in its arguments; a training loop redistributes the same way every step."""
    from dtensor_ext.redistribute.planners import plan

    return plan(shape, mesh_shape, src, dst, dtype=dtype, **dict(options))


def plan_for(shape, mesh, src, dst, dtype, **options) -> Plan:
    """The (cached) plan the executor can run on `mesh`: steps over several mesh dims need a flattened group, which
    torch builds only for meshes with dim names."""
    if mesh.mesh_dim_names is None and mesh.ndim > 1:
        options.setdefault("max_step_dims", 1)
    return _cached_plan(tuple(shape), tuple(mesh.shape), tuple(src), tuple(dst), dtype, tuple(sorted(options.items())))


def gradient_placements(grad_placements, source_placements) -> tuple:
    """Where DTensor's Redistribute sends a gradient: back to the source placements, except that a Partial source
    whose gradient arrives Shard or Replicate gets a Replicate gradient (a Partial gradient stays Partial)."""
    return tuple(
        Replicate() if isinstance(p, Partial) and (is_shard(g) or isinstance(g, Replicate)) else p
        for g, p in zip(grad_placements, source_placements)
    )


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: DTensor, placements, options):
        ctx.source, ctx.options = tuple(tensor.placements), options
        chosen = plan_for(tensor.shape, tensor.device_mesh, ctx.source, placements, tensor.dtype, **options)
        return execute(tensor, chosen)

    @staticmethod
    def backward(ctx, grad: DTensor):
        # a peak cap was chosen for the forward's tensors; the gradient's layouts differ, so it does not carry over
        options = {k: v for k, v in ctx.options.items() if k != "max_peak_bytes"}
        target = gradient_placements(grad.placements, ctx.source)
        return redistribute(grad, target, **options), None, None


def redistribute(tensor: DTensor, placements, *, planner: str = "optimal", **plan_options) -> DTensor:
    """`tensor.redistribute(mesh, placements)` along the chosen planner's plan; differentiable like DTensor's."""
    if planner == "dtensor":
        return tensor.redistribute(tensor.device_mesh, tuple(placements))
    if tuple(placements) == tuple(tensor.placements):
        return tensor
    return _Redistribute.apply(tensor, tuple(placements), dict(plan_options, planner=planner))
