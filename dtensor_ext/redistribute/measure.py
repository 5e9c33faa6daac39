"""Recording the functional collectives that ran (real ranks or simulated ones), with their input and output
shapes per rank: how tests and benchmarks measure what a redistribution moved."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtensor_ext._compat import TorchDispatchMode, local_tensor_values, process_group_of
from dtensor_ext.redistribute.layout import coordinates

__all__ = ["CollectiveRecorder"]

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
