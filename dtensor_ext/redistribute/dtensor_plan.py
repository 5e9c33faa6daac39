"""DTensor's own redistribution, priced like the planner's steps: the steps torch plans (read from its planner, which
caches them), each with the bytes every rank receives when torch runs it on real ranks.

The engine compares this with the planner's plan to decide who moves a tensor. `plan(planner="dtensor")` (the
`plan` command's DTensor column) prints it for a CPU job of real gloo ranks, reading torch's planner on a mesh
description: nothing runs, and where a step runs differently elsewhere (Shard(i) -> Shard(j) is one all_to_all on
NCCL or under simulated ranks, a gather of the mesh dim on gloo) the gloo way is the one shown.
Bytes are the elements a rank lacks and receives (padding of uneven shards not counted, as in the planner's steps),
so a plan that moves the same elements in other collectives ties with torch, and torch keeps the move.
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, Partial, Replicate, StridedShard, TensorMeta
from dtensor_ext.redistribute.placements import format_placements
from dtensor_ext.redistribute.placements import is_shard
from dtensor_ext.redistribute.plan import Step
from dtensor_ext.redistribute.steps import StepBuilder

__all__ = ["DTensorRedistributeFailed", "dtensor_steps", "gloo_dtensor_steps"]


class DTensorRedistributeFailed(RuntimeError):
    """torch's own redistribute refuses this request, so there is no DTensor plan to compare with."""


def gloo_dtensor_steps(builder: StepBuilder, src: tuple, dst: tuple) -> list[Step]:
    """The steps torch runs for `src` -> `dst` on a CPU mesh of real gloo ranks (see the module docstring)."""
    stride = tuple(torch.empty(builder.shape, device="meta").stride())
    meta = TensorMeta(torch.Size(builder.shape), stride, builder.dtype)
    # torch warns about its own sequential collectives while planning
    with _compat.quiet_redistribute_warnings(), _compat.mesh_description(builder.mesh_shape) as mesh:
        try:
            transforms = _compat.redistribution_transforms(
                DTensorSpec(mesh, tuple(src), tensor_meta=meta), DTensorSpec(mesh, tuple(dst), tensor_meta=meta)
            )
        except (RuntimeError, ValueError, AssertionError, NotImplementedError) as exc:
            raise DTensorRedistributeFailed(
                f"torch {torch.__version__} DTensor.redistribute {format_placements(src)} -> {format_placements(dst)}"
                f" of {builder.shape} on mesh {builder.mesh_shape} refused: {exc}"
            ) from exc
    return dtensor_steps(builder, src, transforms, shard_to_shard_gathers=True)


def _strided(*placements) -> bool:
    return any(isinstance(p, StridedShard) for p in placements)


def dtensor_steps(builder: StepBuilder, src: tuple, transforms, shard_to_shard_gathers: bool) -> list[Step]:
    """Steps of torch's plan `transforms` ((mesh dims, from, to) each, as `_compat.redistribution_transforms`
    gives) from placements `src`. `shard_to_shard_gathers`: torch moves Shard(i) -> Shard(j) by gathering the mesh
    dim and keeping a chunk (CPU meshes of real processes) instead of one all_to_all."""
    steps, state = [], tuple(src)
    for mesh_dims, before, after in transforms:
        target = tuple(after if j in mesh_dims else p for j, p in enumerate(state))
        if isinstance(before, Partial) and isinstance(after, Replicate):
            steps.append(builder.all_reduce_over(state, mesh_dims))
        elif isinstance(before, Partial):
            steps.append(builder.reduce_scatter_over(state, mesh_dims, after.dim))
        elif is_shard(before) and is_shard(after) and (shard_to_shard_gathers or _strided(before, after)):
            # torch moves a _StridedShard to or from a Shard through Replicate: a gather, then a local cut
            gathered = tuple(Replicate() if j in mesh_dims else p for j, p in enumerate(state))
            step = _collective(builder, builder.exchange(state, gathered), "all_gather", mesh_dims)
            steps.append(Step("all_gather", step.mesh_dims, state, target, step.recv_bytes, step.buffer_bytes, step.time_s))
        elif is_shard(before) and is_shard(after):
            # Shard(i) -> Shard(j): one all_to_all of the mesh dim, also where only pairs exchange (2 ranks)
            steps.append(builder.as_collective(_collective(builder, builder.exchange(state, target), "all_to_all",
                                                           mesh_dims), "all_to_all"))
        elif is_shard(before):
            steps.append(_collective(builder, builder.exchange(state, target), "all_gather", mesh_dims))
        else:  # Replicate -> Shard or Partial: a local cut
            steps.append(Step("local", (), state, target, (0,) * builder.world, builder.buffer_bytes(target), 0.0))
        state = target
    return steps



def _collective(builder: StepBuilder, step: Step, kind: str, mesh_dims) -> Step:
    """`step` as torch runs it: a `kind` collective over `mesh_dims` also where no rank receives anything (a tensor
    with no elements, such as a rotary split's empty pass-through part, is still gathered: one latency)."""
    if step.kind != "local":
        return step
    return Step(kind, tuple(mesh_dims), step.before, step.after, step.recv_bytes, step.buffer_bytes,
                builder.cost.collective_time(kind, tuple(mesh_dims), 0))
