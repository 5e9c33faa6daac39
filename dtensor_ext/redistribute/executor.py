"""Running a plan on real DTensors with functional collectives, and `redistribute` with autograd.

Data-moving steps pack each rank's outgoing pieces into one buffer and run one `all_to_all_single` with
per-rank split sizes on the process group of the mesh dims the step spans (a flattened group where it spans
several: torch's flattened mesh where the mesh has dim names, a group of its own otherwise), so the bytes on the
wire are exactly the plan's; a gather in which every rank receives each group member's whole block runs as
`all_gather_into_tensor`. Reductions run on the mesh dim's process group (`all_reduce`, `reduce_scatter_tensor`),
or, for a reduce_exchange, as two such all-to-alls with a local reduction between. Ranks are numbered by their
coordinate in the DTensor's mesh, so any DeviceMesh works (a sub-mesh, non-contiguous rank orders). Under a
simulated mesh every rank's part is computed in this process.
With an autotune calibration file, its measured choices decide how gathers over several mesh dims and one-dim
exchanges run (dtensor_ext.redistribute.choices), and the plan `plan_for` returns has those steps; send/recv
pairs need real processes, so a simulated mesh runs those exchanges as all_to_all_single.
"""
from __future__ import annotations

import dataclasses
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
    funcol,
    local_int,
    local_tensor_values,
    mesh_coordinates_by_rank,
)
from dtensor_ext.redistribute.choices import Choices, calibration_for
from dtensor_ext.redistribute.cost import IdealCostModel
from dtensor_ext.redistribute.placements import is_shard
from dtensor_ext.redistribute.layout import Layout, coordinates, layout_of
from dtensor_ext.redistribute.plan import Plan, Step, Transfer
from dtensor_ext.redistribute.steps import StepBuilder, replace_placement

__all__ = ["execute", "redistribute"]


class _Ranks:
    """Where this process's rank(s) sit in the plan's mesh: global rank -> row-major index of its coordinate."""

    def __init__(self, mesh, mesh_shape):
        coords = mesh_coordinates_by_rank(mesh)
        self.simulated = enabled_local_tensor_mode() is not None  # asked once: per_rank disables the mode inside
        self.mesh, self.mesh_shape = mesh, tuple(mesh_shape)
        self.index = {r: _row_major(c, mesh_shape) for r, c in coords.items()}
        self.coords = coordinates(mesh_shape)
        self._groups: dict = {}
        self._memo: dict = {}

    def memo(self, key, make):
        """make() once per key: a Program runs the same steps every call, so their routing is worked out once."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def per_rank(self, fn, *tensors):
        """fn(mesh index, *that rank's tensors) on every simulated rank, or on this process's rank."""
        tensors = [t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t for t in tensors]
        if not self.simulated:
            (rank,) = self.index
            return fn(self.index[rank], *tensors)
        mode = enabled_local_tensor_mode()
        # LocalTensorMode keeps a plain tensor where every rank's is the same (e.g. a replicated parameter)
        per_rank = [local_tensor_values(t) or dict.fromkeys(mode.ranks, t) for t in tensors]
        with mode.disable():
            return LocalTensor({r: fn(self.index[r], *[values[r] for values in per_rank]) for r in sorted(mode.ranks)})

    def ints(self, values_by_index):
        """One int per rank (values_by_index(mesh index)), as collectives take split sizes."""
        if not self.simulated:
            return values_by_index(next(iter(self.index.values())))
        return {r: values_by_index(i) for r, i in self.index.items()}

    def group(self, mesh_dims: tuple[int, ...]):
        """(process group argument, members of `index`'s group in group order) for a step over `mesh_dims`, worked
        out once per mesh dims (reading the mesh's rank tensor costs more than the rest of a small move)."""
        if mesh_dims not in self._groups:
            self._groups[mesh_dims] = self._group(mesh_dims)
        return self._groups[mesh_dims]

    def _group(self, mesh_dims: tuple[int, ...]):
        group = (self.mesh, mesh_dims[0]) if len(mesh_dims) == 1 else _flat_group(self.mesh, mesh_dims, self.simulated)
        if not self.simulated:
            # c10d numbers a group's ranks in global rank order, which differs from mesh coordinate order on
            # meshes with a non-contiguous rank layout
            index_of = {g: i for i, g in enumerate(self.mesh.mesh.flatten().tolist())}
            order = [index_of[g] for g in dist.get_process_group_ranks(_process_group(group))]
            return group, lambda index: order

        def members(index: int) -> list[int]:
            coord = self.coords[index]
            free = [range(n) if d in mesh_dims else (coord[d],) for d, n in enumerate(self.mesh_shape)]
            return [_row_major(c, self.mesh_shape) for c in itertools.product(*free)]

        return group, members


def _flat_group(mesh, mesh_dims: tuple[int, ...], simulated: bool):
    """The group of the ranks sharing this rank's coordinates off `mesh_dims`, made once with dist.new_group, which
    only the group's own ranks enter (the plan runs on every rank of the mesh, so each group's ranks make it
    together). Under simulated ranks the first rank's group stands for all of them, as mesh dim groups do there.
    Not torch's DeviceMesh._flatten: a flattened mesh registered on the mesh makes torch merge its own gathers onto
    it, which for uneven nested shards gives wrong values (torch 2.13: S1,S1 -> R,R of 6 columns on 2x2)."""
    # kept on the mesh object: meshes compare equal by shape and ranks, and a group lives as long as its mesh's
    groups = mesh.__dict__.setdefault("_dtensor_ext_flat_groups", {})
    if mesh_dims not in groups:
        coordinate = (0,) * mesh.ndim if simulated else mesh.get_coordinate()
        index = tuple(slice(None) if d in mesh_dims else int(c) for d, c in enumerate(coordinate))
        members = sorted(mesh.mesh[index].flatten().tolist())
        groups[mesh_dims] = dist.new_group(members, use_local_synchronization=True)
    return groups[mesh_dims]


def _process_group(group):
    return group[0].get_group(group[1]) if isinstance(group, tuple) else group


def _row_major(coord, mesh_shape) -> int:
    index = 0
    for c, n in zip(coord, mesh_shape):
        index = index * n + c
    return index


@functools.lru_cache(maxsize=65536)  # pure in its interval tuples; a plan's steps ask for the same ones every call
def _positions(held, wanted) -> tuple[slice | torch.Tensor, ...]:
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
    return tuple(out)


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


def _all_to_all(ranks: _Ranks, step: Step, transfers, pack, *local, send_recv: bool = False):
    """One all_to_all_single carrying `transfers` on the group of the step's mesh dims (batched isend/irecv pairs
    where `send_recv` and the ranks are real processes); pack(rank, *that rank's tensors, its outgoing transfers in
    destination order) gives the tensors it sends. Returns the received buffer (pieces in source order)."""
    group, members = ranks.group(step.mesh_dims)
    outgoing, output_sizes, input_sizes = ranks.memo(("all_to_all", id(transfers)), lambda: _routes(ranks, transfers, members))

    def flat(r, *xs):
        parts = [p.reshape(-1) for p in pack(r, *xs, outgoing[r])]
        return torch.cat(parts) if parts else xs[0].new_zeros(0)

    if send_recv and not ranks.simulated:
        return _send_recv(ranks.per_rank(flat, *local), output_sizes, input_sizes, group)
    return funcol.all_to_all_single(ranks.per_rank(flat, *local), output_sizes, input_sizes, group)


def _routes(ranks: _Ranks, transfers, members):
    """(mesh index -> its outgoing transfers in destination order, output split sizes, input split sizes) of an
    all_to_all carrying `transfers`: per group position, the elements a rank receives from (sends to) the member
    there."""
    sizes: dict[tuple[int, int], int] = {}
    outgoing: dict[int, list] = {}
    for t in transfers:
        sizes[t.src, t.dst] = sizes.get((t.src, t.dst), 0) + _numel(t.block)
    for i in ranks.index.values():
        order = members(i)
        outgoing[i] = sorted((t for t in transfers if t.src == i), key=lambda t: order.index(t.dst))

    def split_sizes(sending: bool) -> list:
        out = []
        for position in range(len(members(0))):
            def elements(i, position=position):
                peer = members(i)[position]
                return sizes.get((i, peer) if sending else (peer, i), 0)

            values = ranks.ints(elements)
            out.append(local_int(values) if isinstance(values, dict) else values)
        return out

    return outgoing, split_sizes(False), split_sizes(True)


def _send_recv(buffer: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group) -> torch.Tensor:
    """all_to_all_single's exchange as one batch of isend/irecv pairs (the autotuner's `send_recv`)."""
    process_group = _process_group(group)
    peers, me = dist.get_process_group_ranks(process_group), dist.get_rank()
    sends, received = buffer.split(input_sizes), [buffer.new_empty(n) for n in output_sizes]
    ops = []
    for position, peer in enumerate(peers):
        if peer == me:
            received[position].copy_(sends[position])
            continue
        if input_sizes[position]:
            ops.append(dist.P2POp(dist.isend, sends[position].contiguous(), peer, process_group))
        if output_sizes[position]:
            ops.append(dist.P2POp(dist.irecv, received[position], peer, process_group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return torch.cat(received)


def _received(ranks: _Ranks, transfers, rank: int, buffer: torch.Tensor, members):
    """(transfer, its tensor) for each piece `rank` received, in the order `_all_to_all` laid them out."""

    def layout():
        order, offset, out = members(rank), 0, []
        for t in sorted((t for t in transfers if t.dst == rank), key=lambda t: order.index(t.src)):
            shape = [sum(b - a for a, b in d) for d in t.block]
            out.append((t, offset, shape))
            offset += math.prod(shape)
        return out

    for t, offset, shape in ranks.memo(("received", id(transfers), rank), layout):
        yield t, buffer[offset : offset + math.prod(shape)].reshape(shape)


def _numel(block) -> int:
    return math.prod(sum(b - a for a, b in d) for d in block)


def _picker(before: Layout):
    """pack function for `_all_to_all`: each outgoing transfer's elements cut from the sender's local tensor."""
    return lambda r, x, outgoing: [_select(x, _positions(before.blocks[r], t.block)) for t in outgoing]


def _gathers_whole_blocks(ranks: _Ranks, step: Step, before: Layout) -> bool:
    """Whether every rank receives the whole local block of each other member of its group, all blocks of one size:
    a step all_gather_into_tensor runs with exactly the plan's bytes."""
    if step.kind != "all_gather" or len({before.local_numel(r) for r in range(len(before.blocks))}) != 1:
        return False
    members = ranks.group(step.mesh_dims)[1]
    incoming: dict[int, set] = {}
    for t in step.transfers:
        if t.block != before.blocks[t.src]:
            return False
        incoming.setdefault(t.dst, set()).add(t.src)
    return all(incoming.get(r, set()) == set(members(r)) - {r} for r in range(len(before.blocks)))


# all_gather_single where this torch has it (2.13 deprecates all_gather_tensor)
_gather_flat = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _all_gather(ranks: _Ranks, local, step: Step, before: Layout, after: Layout):
    """The step as one all_gather of every member's local block, each placed where the target layout holds it."""
    group, members = ranks.group(step.mesh_dims)
    numel = before.local_numel(0)
    gathered = _gather_flat(ranks.per_rank(lambda r, x: x.contiguous().reshape(-1), local), 0, group)

    def unpack(r, pieces):
        out = pieces.new_zeros(after.local_shapes[r])
        for position, m in enumerate(members(r)):
            piece = pieces[position * numel : (position + 1) * numel].reshape(before.local_shapes[m])
            _assign(out, _positions(after.blocks[r], before.blocks[m]), piece)
        return out

    return ranks.per_rank(unpack, gathered)


def _exchange(ranks: _Ranks, local, step: Step, before: Layout, after: Layout, send_recv: bool = False):
    def unpack(r, x, received=None):
        out = x.new_zeros(after.local_shapes[r])
        kept = after.overlap(r, before, r)
        if _numel(kept):
            _assign(out, _positions(after.blocks[r], kept), _select(x, _positions(before.blocks[r], kept)))
        if received is not None:
            for t, piece in _received(ranks, step.transfers, r, received, ranks.group(step.mesh_dims)[1]):
                _assign(out, _positions(after.blocks[r], t.block), piece)
        return _zero_new_partials(r, out, step, before)

    if not step.transfers:
        return ranks.per_rank(unpack, local)
    received = _all_to_all(ranks, step, step.transfers, _picker(before), local, send_recv=send_recv)
    return ranks.per_rank(unpack, local, received)


def _reduce_exchange(ranks: _Ranks, local, step: Step, before: Layout, after: Layout):
    """Partial pieces to the merging ranks, a local reduction there, the results to the ranks that need them."""
    # kept per step: the routing memo is keyed by the transfers' identity
    gather = ranks.memo(("merges", id(step)), lambda: tuple(Transfer(src, m.rank, m.block) for m in step.merges for src in m.sources))
    reduce_op = next(p.reduce_op for p, q in zip(step.before, step.after) if isinstance(p, Partial) and p != q)

    def merge(r, x, pieces) -> torch.Tensor:
        """The reduced values of every block rank r merges, flattened one after another in merge order."""
        parts = {m.block: [_select(x, _positions(before.blocks[r], m.block))] for m in step.merges if m.rank == r}
        for t, piece in _received(ranks, gather, r, pieces, ranks.group(step.mesh_dims)[1]):
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
            for t, piece in _received(ranks, step.transfers, r, received, ranks.group(step.mesh_dims)[1]):
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


def execute(tensor: DTensor, plan: Plan, choices: Choices = Choices()) -> DTensor:
    """Run `plan` on `tensor` (which must match its shape, dtype and source placements) with the calibrated
    implementation `choices` (see dtensor_ext.redistribute.choices)."""
    if tuple(tensor.shape) != plan.shape or tuple(tensor.placements) != plan.src or tensor.dtype != plan.dtype:
        raise ValueError(
            f"plan for {plan.shape} {plan.dtype} {plan.src} given a tensor {tuple(tensor.shape)} {tensor.dtype} "
            f"{tuple(tensor.placements)}"
        )
    local = execute_local(tensor._local_tensor, tensor.device_mesh, as_chosen(plan, tensor.device_mesh, choices))
    return DTensor.from_local(local, tensor.device_mesh, plan.dst, run_check=False, shape=tensor.shape, stride=tensor.stride())


class Program:
    """A plan made ready to run on one mesh, once: each step's layouts and whether it runs as an all_gather."""

    def __init__(self, mesh, plan: Plan):
        if plan.planner == "dtensor":
            raise ValueError("the 'dtensor' plan is a record of torch's own redistribute; run DTensor.redistribute")
        if tuple(mesh.shape) != plan.mesh_shape:
            raise ValueError(f"plan for mesh {plan.mesh_shape} given a mesh of shape {tuple(mesh.shape)}")
        self.mesh, self.plan = mesh, plan
        self.ranks = _Ranks(mesh, plan.mesh_shape)
        self.steps = []
        for step in plan.steps:
            before, after = layout_of(plan.shape, plan.mesh_shape, step.before), layout_of(plan.shape, plan.mesh_shape, step.after)
            self.steps.append((step, before, after, _gathers_whole_blocks(self.ranks, step, before)))

    def run(self, local: torch.Tensor) -> torch.Tensor:
        ranks, mesh = self.ranks, self.mesh
        for step, before, after, gathers in self.steps:
            if step.kind == "all_reduce":
                local = _all_reduce(local, step, mesh)
            elif step.kind == "reduce_scatter":
                local = _reduce_scatter(ranks, local, step, mesh, before, after)
            elif step.kind == "reduce_exchange":
                local = _reduce_exchange(ranks, local, step, before, after)
            elif gathers:
                local = _all_gather(ranks, local, step, before, after)
            else:
                local = _exchange(ranks, local, step, before, after, step.send_recv)
        if isinstance(local, funcol.AsyncCollectiveTensor):
            local = local.wait()
        return local


def execute_local(local: torch.Tensor, mesh, plan: Plan) -> torch.Tensor:
    """This rank's local tensor (every simulated rank's, under LocalTensorMode) after running `plan` on `mesh`,
    step by step as the plan says."""
    return Program(mesh, plan).run(local) if plan.steps else local


def as_chosen(plan: Plan, mesh, choices: Choices) -> Plan:
    """The plan with its steps as the calibrated choices run them: gathers over several mesh dims split per dim or
    merged into one on the flattened group, exchanges on one mesh dim as all_to_all_single or send/recv pairs
    (Step.send_recv). Its steps, bytes and modelled times are what the executor runs."""
    if not choices.measured:
        return plan
    builder = StepBuilder(plan.shape, plan.mesh_shape, plan.dtype, IdealCostModel().bind(plan.mesh_shape))
    out: list[Step] = []
    for step in plan.steps:
        previous = out[-1] if out else None
        if step.kind == "all_gather" and previous is not None and previous.kind == "all_gather":
            dims = tuple(sorted({*previous.mesh_dims, *step.mesh_dims}))
            contributed = builder.buffer_bytes(previous.before)  # the autotuner's size: what each rank puts in
            if choices.pick("all_gather_over_dims", dims, contributed) == "flattened":
                out[-1] = builder.exchange(previous.before, step.after)
                continue
        if step.kind == "all_gather" and len(step.mesh_dims) > 1:
            if choices.pick("all_gather_over_dims", step.mesh_dims, builder.buffer_bytes(step.before)) == "per_dim":
                out.extend(_per_dim_gathers(builder, step))
                continue
        out.append(dataclasses.replace(step, send_recv=_sends_and_receives(step, plan.mesh_shape, choices)))
    return dataclasses.replace(plan, steps=tuple(out))
def _per_dim_gathers(builder: StepBuilder, step: Step) -> list[Step]:
    """The step as one exchange per changed mesh dim, innermost first (as DTensor gathers)."""
    parts, state = [], step.before
    for mesh_dim in reversed(range(len(state))):
        if state[mesh_dim] != step.after[mesh_dim]:
            target = replace_placement(state, mesh_dim, step.after[mesh_dim])
            parts.append(builder.exchange(state, target))
            state = target
    return parts


def _sends_and_receives(step: Step, mesh_shape, choices: Choices) -> bool:
    if step.kind not in ("all_to_all", "permute") or len(step.mesh_dims) != 1:
        return False
    n = mesh_shape[step.mesh_dims[0]]
    buffer = max(step.recv_bytes) * n // (n - 1)  # the autotuner's size: the per-rank all-to-all buffer
    return choices.pick("all_to_all", step.mesh_dims, buffer) == "send_recv"


@functools.lru_cache(maxsize=4096)
def _cached_plan(shape, mesh_shape, src, dst, dtype, options) -> Plan:
    """Planning is pure in its arguments; a training loop redistributes the same way every step."""
    from dtensor_ext.redistribute.planners import plan

    return plan(shape, mesh_shape, src, dst, dtype=dtype, **dict(options))


def plan_for(shape, mesh, src, dst, dtype, calibration=None, **options) -> Plan:
    """The (cached) plan the executor runs on `mesh`, step for step. Where the calibration file (`calibration`,
    default $DTENSOR_EXT_CALIBRATION) has an entry for this mesh and dtype, its alpha/beta price the steps (unless
    a cost_model is given) and its measured choices decide how they run (see as_chosen)."""
    model, choices = calibration_for(calibration, mesh, dtype)
    if model is not None:
        options.setdefault("cost_model", model)
    key = (tuple(shape), tuple(mesh.shape), tuple(src), tuple(dst), dtype, tuple(sorted(options.items(), key=str)))
    return as_chosen(_cached_plan(*key), mesh, choices)


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
    """`tensor.redistribute(mesh, placements)` along the chosen planner's plan; differentiable like DTensor's.
    `calibration=path` (default $DTENSOR_EXT_CALIBRATION) runs it with an autotune file's choices (see plan_for)."""
    if planner == "dtensor":
        from dtensor_ext.redistribute.engine import torch_redistribution  # the engine wraps this module

        with torch_redistribution():
            return tensor.redistribute(tensor.device_mesh, tuple(placements))
    if tuple(placements) == tuple(tensor.placements):
        return tensor
    return _Redistribute.apply(tensor, tuple(placements), dict(plan_options, planner=planner))
