"""A redistribution plan: ordered steps with the bytes each rank receives and the buffer it holds afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dtensor_ext._compat import Placement
from dtensor_ext.redistribute.placements import format_placements

__all__ = ["Transfer", "Merge", "Step", "Plan", "format_bytes"]


@dataclass(frozen=True)
class Transfer:
    """Rank `src` sends rank `dst` the elements of `block` (per-dim index intervals)."""

    src: int
    dst: int
    block: tuple


@dataclass(frozen=True)
class Merge:
    """Rank `rank` combines its own partial value of `block` with one from each of `sources`, and keeps the
    result if `keeps` (it needs those elements in the target layout)."""

    rank: int
    block: tuple
    sources: tuple[int, ...]
    keeps: bool


@dataclass(frozen=True)
class Step:
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | permute | reduce_exchange | local
    mesh_dims: tuple[int, ...]
    before: tuple[Placement, ...] | None
    after: tuple[Placement, ...] | None
    recv_bytes: tuple[int, ...]  # per rank
    buffer_bytes: int  # largest local buffer after the step
    time_s: float
    transfers: tuple[Transfer, ...] = field(default=(), repr=False, compare=False)
    tensor_dim: int | None = None  # reduce_scatter: the dim it scatters
    # reduce_exchange: pieces go to `merges` first (one all-to-all), then `transfers` carry the results
    merges: tuple[Merge, ...] = field(default=(), repr=False, compare=False)
    send_recv: bool = False  # an exchange run as batched isend/irecv pairs (a calibration file's choice)

    def describe(self) -> str:
        dims = ",".join(map(str, self.mesh_dims)) or "-"
        change = ""
        if self.before is not None and self.after is not None:
            change = f"{format_placements(self.before)} -> {format_placements(self.after)}"
        kind = f"{self.kind} (send/recv)" if self.send_recv else self.kind
        return (
            f"{kind:<15} mesh dims ({dims:<5}) {change:<28} recv {format_bytes(max(self.recv_bytes, default=0))}"
            f"  buffer {format_bytes(self.buffer_bytes)}  {self.time_s * 1e6:9.1f} us"
        )


@dataclass(frozen=True)
class Plan:
    planner: str
    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    dtype: torch.dtype
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    steps: tuple[Step, ...]
    source_bytes: int  # largest local buffer before the first step
    work: int = field(default=0, compare=False)  # planning effort: rank pairs examined (see planners.DEFAULT_BUDGET)
    exhaustive: bool = field(default=True, compare=False)  # False: the search stopped at its budget

    @property
    def recv_bytes_per_rank(self) -> tuple[int, ...]:
        ranks = len(self.steps[0].recv_bytes) if self.steps else 0
        return tuple(sum(s.recv_bytes[r] for s in self.steps) for r in range(ranks))

    @property
    def max_recv_bytes(self) -> int:
        return max(self.recv_bytes_per_rank, default=0)

    @property
    def peak_bytes(self) -> int:
        return max([self.source_bytes, *(s.buffer_bytes for s in self.steps)])

    @property
    def time_s(self) -> float:
        return sum(s.time_s for s in self.steps)

    def __str__(self) -> str:
        head = (
            f"{self.planner} plan {tuple(self.shape)} {str(self.dtype).removeprefix('torch.')} on mesh "
            f"{tuple(self.mesh_shape)}: {format_placements(self.src)} -> {format_placements(self.dst)}"
        )
        lines = [head, *(f"  {i}. {s.describe()}" for i, s in enumerate(self.steps, 1))]
        if not self.steps:
            lines.append("  (nothing to do)")
        lines.append(
            f"  total: max recv {format_bytes(self.max_recv_bytes)}, peak {format_bytes(self.peak_bytes)}, "
            f"modelled {self.time_s * 1e6:.1f} us"
        )
        return "\n".join(lines)


def format_bytes(nbytes: int) -> str:
    """One unit everywhere a plan or bound is printed: bytes, with thousands separators."""
    return f"{nbytes:,} B"
