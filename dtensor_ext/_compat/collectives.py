"""Process groups, meshes and collectives: what the planner, the autotuner and the passes run collectives on."""

from __future__ import annotations

import contextlib
from typing import Any

from dtensor_ext._compat.testing import enabled_local_tensor_mode


def process_group_of(group_name: Any):
    """The process group a functional collective names (its ``group_name`` argument)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def group_size(group_name: Any) -> int:
    return process_group_of(group_name).size()


def default_store():
    """The c10d key-value store of the default process group (private in torch); holds the tuner's failure flag."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def flat_collectives():
    """(all_gather, reduce_scatter) on flat tensors: the *_single names where this torch has them (2.13+ deprecates
    the *_into_tensor/*_tensor names), the older names otherwise."""
    import torch.distributed as dist

    return (
        getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
        getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,
    )


def mesh_coordinates_by_rank(mesh) -> dict[int, tuple[int, ...]]:
    """Global rank -> its coordinate in `mesh` (every simulated rank under LocalTensorMode, where a sub-mesh stands
    for the slice each rank belongs to; only this rank otherwise); empty where this rank is not in `mesh`."""
    import torch.distributed as dist

    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return {}
    mode = enabled_local_tensor_mode()
    if mode is None:
        return {dist.get_rank(): tuple(int(c) for c in coordinate)}

    def on(c, rank: int) -> int:
        node = getattr(c, "node", None)
        if node is None:
            return int(c)
        values = getattr(node, "_local_ints", None)
        return values[rank] if values is not None else node.maybe_as_int()  # the same on every rank

    return {rank: tuple(on(c, rank) for c in coordinate) for rank in sorted(mode.ranks)}


@contextlib.contextmanager
def mesh_description(mesh_shape: tuple[int, ...]):
    """A DeviceMesh of ranks 0..n-1 in row-major order with no process groups of its own, for reading torch's
    redistribution planner (which wants a mesh, never runs a collective on it); where no process group exists, a
    'fake' one stands in for the duration."""
    import math

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    world = math.prod(mesh_shape)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", rank=0, world_size=world)
    try:
        yield DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape), _init_backend=False)
    finally:
        if owned:
            dist.destroy_process_group()
