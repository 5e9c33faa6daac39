"""The "dtensor" planner: run torch's own `DTensor.redistribute` on a simulated mesh and record its collectives.

Every functional collective it issues becomes a step, with per-rank bytes taken from the tensors that actually
went in and came out, so the comparison reflects what the running torch does, not a model of it.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtensor_ext._compat import (
    TorchDispatchMode,
    enabled_local_tensor_mode,
    local_tensor_values,
    process_group_of,
    quiet_redistribute_warnings,
)
from dtensor_ext.redistribute import engine
from dtensor_ext.redistribute.layout import Layout, coordinates
from dtensor_ext.redistribute.placements import format_placements
from dtensor_ext.redistribute.plan import Step
from dtensor_ext.testing.layout import chunk_sizes
from dtensor_ext.testing.mesh import simulated_mesh

__all__ = ["CollectiveRecorder", "DTensorRedistributeFailed", "dtensor_steps"]


class DTensorRedistributeFailed(RuntimeError):
    """torch's own redistribute raised for this request, so there is no DTensor plan to compare with."""

# op name -> (kind, index of the group argument)
_COLLECTIVES = {
    "all_gather_into_tensor": ("all_gather", 2),
    "reduce_scatter_tensor": ("reduce_scatter", 3),
    "all_reduce": ("all_reduce", 2),
    "all_to_all_single": ("all_to_all", 3),
    "shard_dim_alltoall": ("all_to_all", 3),
}


class CollectiveRecorder(TorchDispatchMode):
    """Records (kind, group name, per-rank input and output tensors, args) of every functional collective."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if func.namespace in ("_c10d_functional", "_dtensor") and name in _COLLECTIVES:
            kind, group_arg = _COLLECTIVES[name]
            self.calls.append((kind, args[group_arg], _per_rank(args[0]), _per_rank(out), args))
        return out


def _per_rank(t) -> dict[int, torch.Size]:
    locals_ = local_tensor_values(t)
    return {r: v.shape for r, v in locals_.items()} if locals_ is not None else {dist.get_rank(): t.shape}


def _mesh_dims_of_group(group_name, mesh_shape) -> tuple[int, ...]:
    ranks = dist.get_process_group_ranks(process_group_of(group_name))
    coords = coordinates(mesh_shape)
    return tuple(j for j in range(len(mesh_shape)) if len({coords[r][j] for r in ranks}) > 1)


def dtensor_steps(shape, mesh_shape, src, dst, dtype, cost_model) -> list[Step]:
    itemsize = torch.empty((), dtype=dtype).element_size()
    world = math.prod(mesh_shape)
    source = Layout(shape, mesh_shape, src)
    recorder = CollectiveRecorder()
    outer = contextlib.nullcontext() if enabled_local_tensor_mode() is not None else simulated_mesh(mesh_shape)
    # torch warns about its own sequential collectives on every call
    with quiet_redistribute_warnings(), outer:
        with simulated_mesh(mesh_shape) as mesh:
            mode = enabled_local_tensor_mode()
            local = mode.rank_map(lambda r: torch.zeros(source.local_shapes[r], dtype=dtype))
            stride = tuple(torch.empty(shape, device="meta").stride())
            tensor = DTensor.from_local(local, mesh, src, run_check=False, shape=torch.Size(shape), stride=stride)
            with recorder, engine.torch_redistribution():  # torch's own plan, also with install(planner=True)
                try:
                    tensor.redistribute(mesh, dst)
                except (RuntimeError, ValueError, AssertionError) as exc:
                    raise DTensorRedistributeFailed(
                        f"torch {torch.__version__} DTensor.redistribute {format_placements(src)} -> "
                        f"{format_placements(dst)} of {tuple(shape)} on mesh {tuple(mesh_shape)} failed: {exc}"
                    ) from exc
    steps = []
    for kind, group, inputs, outputs, args in recorder.calls:
        mesh_dims = _mesh_dims_of_group(group, mesh_shape)
        n = math.prod(mesh_shape[j] for j in mesh_dims)
        numel_in = {r: math.prod(s) for r, s in inputs.items()}
        numel_out = {r: math.prod(s) for r, s in outputs.items()}
        if kind == "all_gather":
            recv = {r: numel_out[r] - numel_in[r] for r in inputs}
            ring = max(numel_out.values())
        elif kind == "reduce_scatter":
            recv = {r: (n - 1) * numel_out[r] for r in inputs}
            ring = max(numel_in.values())
        elif kind == "all_reduce":
            recv = {r: -(-2 * (n - 1) * numel_in[r] // n) for r in inputs}
            ring = max(numel_in.values())
        else:
            recv = {r: numel_out[r] - _kept(inputs[r], args, n, r, mesh_shape, mesh_dims) for r in inputs}
            ring = -(-max(recv.values()) * n // (n - 1))
        per_rank = tuple(recv.get(r, 0) * itemsize for r in range(world))
        time_s = cost_model.collective_time(kind, mesh_dims, ring * itemsize)
        steps.append(Step(kind, mesh_dims, None, None, per_rank, max(numel_out.values()) * itemsize, time_s))
    return steps


def _kept(shape_in: torch.Size, args, n: int, rank: int, mesh_shape, mesh_dims) -> int:
    """Elements an all-to-all leaves on the rank itself: its own chunk along the scattered dim."""
    if len(args) == 4 and isinstance(args[2], int):  # shard_dim_alltoall(input, gather_dim, shard_dim, group)
        shard_dim = args[2]
        coord = coordinates(mesh_shape)[rank]
        index = 0
        for j in mesh_dims:
            index = index * mesh_shape[j] + coord[j]
        rest = math.prod(shape_in) // shape_in[shard_dim] if shape_in[shard_dim] else 0
        return chunk_sizes(shape_in[shard_dim], n)[index] * rest
    return math.prod(shape_in) // n
