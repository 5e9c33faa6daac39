"""Collective steps and the interchangeable ways to run each of them.

A step is one collective on some mesh dims with a given number of bytes per rank. Every implementation of a
step computes the same tensor (tests check this), so the tuner is free to pick the fastest. The first
implementation listed for a collective is the default: what DTensor does today, used whenever tuning fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtensor_ext._compat import flat_collectives
from dtensor_ext.autotune.protocol import Guard

__all__ = ["IMPLEMENTATIONS", "Implementation", "Step", "default_steps", "step_input"]

_all_gather_flat, _reduce_scatter_flat = flat_collectives()

Implementation = Callable[[Guard, tuple[int, ...], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Step:
    collective: str
    mesh_dims: tuple[int, ...]
    nbytes: int  # what each rank contributes

    @property
    def name(self) -> str:
        return f"{self.collective}/mesh_dims={'+'.join(map(str, self.mesh_dims))}/bytes={self.nbytes}"

    def received_bytes(self, mesh_shape: Sequence[int]) -> int:
        """Bytes each rank receives when this step is an all-gather (the quantity beta is fitted against)."""
        if not self.collective.startswith("all_gather"):
            raise ValueError(f"step {self.name}: received bytes are defined here for all-gathers only")
        return (math.prod(mesh_shape[d] for d in self.mesh_dims) - 1) * self.nbytes


def default_steps(mesh_shape: Sequence[int], sizes: Sequence[int], itemsize: int) -> list[Step]:
    """All-gathers per mesh dim first (they calibrate alpha-beta), then the alternatives worth choosing between.

    Sizes are rounded down to whole elements divisible by the group size so every implementation can split them.
    """
    ndim = len(mesh_shape)
    plan: list[tuple[str, tuple[int, ...]]] = [("all_gather", (d,)) for d in range(ndim)]
    if ndim >= 2:
        plan.append(("all_gather_over_dims", (0, 1)))
    plan += [("all_to_all", (d,)) for d in range(ndim)] + [("reduce_scatter", (d,)) for d in range(ndim)]
    steps = []
    for collective, dims in plan:
        unit = itemsize * math.prod(mesh_shape[d] for d in dims)
        for size in sizes:
            steps.append(Step(collective, dims, max(unit, size // unit * unit)))
    return list(dict.fromkeys(steps))  # rounding may merge two sizes


def step_input(step: Step, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Distinct values per rank and position, so that a wrong implementation gives a different tensor."""
    numel = step.nbytes // torch.empty((), dtype=dtype).element_size()
    return (torch.arange(numel, device=device) + dist.get_rank() * numel).to(dtype)


def _gather_into_tensor(g: Guard, dims: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    group = g.groups[dims]
    out = x.new_empty(dist.get_world_size(group) * x.numel())
    g.wait(_all_gather_flat(out, x, group=group, async_op=True), "all_gather_into_tensor")
    return out


def _gather_list(g: Guard, dims: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    group = g.groups[dims]
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    g.wait(dist.all_gather(parts, x, group=group, async_op=True), "all_gather")
    return torch.cat(parts)


def _gather_per_dim(g: Guard, dims: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    for d in reversed(dims):  # innermost first, so the result is in row-major rank order
        x = _gather_into_tensor(g, (d,), x)
    return x


def _all_to_all_single(g: Guard, dims: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    g.wait(dist.all_to_all_single(out, x, group=g.groups[dims], async_op=True), "all_to_all_single")
    return out


def _all_to_all_send_recv(g: Guard, dims: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    group = g.groups[dims]
    n, me = dist.get_world_size(group), dist.get_rank(group)
    sends, out = x.chunk(n), torch.empty_like(x)
    recvs = out.chunk(n)
    recvs[me].copy_(sends[me])
    ops = []
    for peer in range(n):
        if peer != me:
            ops.append(dist.P2POp(dist.isend, sends[peer], group=group, group_peer=peer))
            ops.append(dist.P2POp(dist.irecv, recvs[peer], group=group, group_peer=peer))
    for work in dist.batch_isend_irecv(ops) if ops else []:  # a one-rank group has nobody to talk to
        g.wait(work, "send/recv")
    return out


def _reduce_scatter_tensor(g: Guard, dims: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    group = g.groups[dims]
    out = x.new_empty(x.numel() // dist.get_world_size(group))
    g.wait(_reduce_scatter_flat(out, x, group=group, async_op=True), "reduce_scatter_tensor")
    return out


def _all_reduce_then_slice(g: Guard, dims: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    group = g.groups[dims]
    full = x.clone()
    g.wait(dist.all_reduce(full, group=group, async_op=True), "all_reduce")
    return full.chunk(dist.get_world_size(group))[dist.get_rank(group)].clone()


# collective -> implementations, default first.
IMPLEMENTATIONS: Mapping[str, Mapping[str, Implementation]] = {
    "all_gather": {"all_gather_into_tensor": _gather_into_tensor, "all_gather_list": _gather_list},
    "all_gather_over_dims": {"per_dim": _gather_per_dim, "flattened": _gather_into_tensor},
    "all_to_all": {"all_to_all_single": _all_to_all_single, "send_recv": _all_to_all_send_recv},
    "reduce_scatter": {"reduce_scatter_tensor": _reduce_scatter_tensor, "all_reduce_slice": _all_reduce_then_slice},
}
