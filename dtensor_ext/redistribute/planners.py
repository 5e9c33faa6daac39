"""`plan(...)`: the naive, DTensor and optimal planners behind one entry point.

The optimal planner is A* over placement tuples. Moves: single mesh dim all_reduce / reduce_scatter of Partial
values, a data-moving step that changes one mesh dim's placement, a data-moving step straight to the target
(an all-to-all over the flattened mesh dims it spans, or a pairwise permute), and a reduce_exchange straight to
the target (the Partial pieces to merging ranks, then the results to their owners). The heuristic is the remaining
lower bound (bytes, times the cheapest beta for the time objective), which no sequence of steps can undercut,
so the first plan popped is optimal within these moves. Steps whose buffer exceeds `max_peak_bytes` are pruned.
"""

from __future__ import annotations

import functools
import heapq
import itertools

import torch

from dtensor_ext._compat import Partial, Replicate, Shard
from dtensor_ext.redistribute.cost import IdealCostModel
from dtensor_ext.redistribute.lower_bound import lower_bound, mesh_shape_of, reduced_dims, validate_request
from dtensor_ext.redistribute.placements import format_placements
from dtensor_ext.redistribute.plan import Plan, Step
from dtensor_ext.redistribute.steps import StepBuilder, replace_placement

__all__ = ["PLANNERS", "OBJECTIVES", "NoFeasiblePlan", "plan"]

PLANNERS = ("naive", "dtensor", "optimal")
OBJECTIVES = ("time", "bytes")


class NoFeasiblePlan(ValueError):
    """No sequence of steps stays within the peak-memory cap."""


def plan(
    shape,
    mesh,
    src,
    dst,
    *,
    dtype: torch.dtype = torch.float32,
    cost_model=None,
    max_peak_bytes: int | None = None,
    planner: str = "optimal",
    objective: str = "time",
) -> Plan:
    mesh_shape = mesh_shape_of(mesh)
    shape, src, dst = validate_request(shape, mesh_shape, src, dst)
    if planner not in PLANNERS:
        raise ValueError(f"planner {planner!r}: expected one of {PLANNERS}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: expected one of {OBJECTIVES}")
    model = (cost_model or IdealCostModel()).bind(mesh_shape)
    builder = StepBuilder(shape, mesh_shape, dtype, model)
    if planner == "dtensor":
        from dtensor_ext.redistribute.measure import dtensor_steps

        steps = dtensor_steps(shape, mesh_shape, src, dst, dtype, model)
    elif planner == "naive":
        steps = _naive(builder, src, dst)
    else:
        steps = _optimal(builder, src, dst, max_peak_bytes, objective)
    result = Plan(planner, shape, mesh_shape, dtype, src, dst, tuple(steps), builder.buffer_bytes(src))
    if planner != "optimal" and max_peak_bytes is not None and result.peak_bytes > max_peak_bytes:
        raise NoFeasiblePlan(
            f"the {planner} plan holds {result.peak_bytes} bytes on a rank, over max_peak_bytes={max_peak_bytes}"
        )
    return result


def _naive(builder: StepBuilder, src, dst) -> list[Step]:
    """All-reduce every Partial, gather everything, then keep each rank's target piece."""
    steps, state = [], src
    for mesh_dim in reduced_dims(src, dst, builder.mesh_shape):
        steps.append(builder.all_reduce(state, mesh_dim))
        state = steps[-1].after
    gathered = tuple(p if isinstance(p, Partial) else Replicate() for p in state)
    for target in (gathered, dst):
        step = builder.exchange(state, target)
        if step is not None and target != state:
            steps.append(step)
            state = target
    return steps


def _moves(builder: StepBuilder, state, dst):
    pending = set(reduced_dims(state, dst, builder.mesh_shape))
    for mesh_dim in sorted(pending):
        yield builder.all_reduce(state, mesh_dim)
        for tensor_dim in range(len(builder.shape)):
            yield builder.reduce_scatter(state, mesh_dim, tensor_dim)
    yield builder.exchange(state, dst)
    if pending:
        yield builder.reduce_exchange(state, dst)
    options = [Replicate(), *(Shard(d) for d in range(len(builder.shape)))]
    for mesh_dim, current in enumerate(state):
        if isinstance(current, Partial):
            continue
        for p in dict.fromkeys([*options, dst[mesh_dim]]):
            if p != current and not isinstance(p, Partial):
                yield builder.exchange(state, replace_placement(state, mesh_dim, p))
    for mesh_dim in pending:  # an exact reduction of size-1 mesh dims (no data moves)
        if builder.mesh_shape[mesh_dim] == 1:
            yield builder.exchange(state, replace_placement(state, mesh_dim, Replicate()))


def _optimal(builder: StepBuilder, src, dst, max_peak_bytes, objective) -> list[Step]:
    if max_peak_bytes is not None:
        for what, placements in (("source", src), ("target", dst)):
            if builder.buffer_bytes(placements) > max_peak_bytes:
                raise NoFeasiblePlan(
                    f"max_peak_bytes={max_peak_bytes}: the {what} layout {format_placements(placements)} alone "
                    f"holds {builder.buffer_bytes(placements)} bytes on a rank"
                )
    @functools.lru_cache(maxsize=None)
    def remaining(state):
        """Lower bound from `state` to the target (None where the target's Partial needs a Replicate first)."""
        if any(isinstance(q, Partial) and q != p and not isinstance(p, Replicate) for p, q in zip(state, dst)):
            return None
        return lower_bound(builder.shape, builder.mesh_shape, state, dst, dtype=_dtype_of(builder.itemsize))

    def priority(state, received, spent_time) -> tuple[float, float]:
        """(what is minimised, tie-break), both never above their final values along any completion."""
        bound = remaining(state)
        if objective == "time":
            ahead = bound.max_recv_bytes * builder.cost.min_beta if bound else 0.0
            return spent_time + ahead, max(received)
        # bytes: the busiest rank's total, so the per-rank sums are part of the search state
        ahead = max(max(r + n for r, n in zip(received, bound.recv_bytes_per_rank)), bound.max_recv_bytes) if bound else 0
        return max(max(received), ahead), spent_time

    tie = itertools.count()
    start = (0,) * builder.world
    frontier = [(*priority(src, start, 0.0), next(tie), src, start, 0.0, [])]
    settled: dict[tuple, float] = {}
    while frontier:
        _, _, _, state, received, spent_time, path = heapq.heappop(frontier)
        if state == dst:
            return path
        key = state if objective == "time" else (state, received)
        if key in settled:
            continue
        settled[key] = spent_time
        for step in _moves(builder, state, dst):
            if step is None or step.after == state:
                continue
            if max_peak_bytes is not None and step.buffer_bytes > max_peak_bytes:
                continue
            now = tuple(a + b for a, b in zip(received, step.recv_bytes))
            heapq.heappush(
                frontier,
                (*priority(step.after, now, spent_time + step.time_s), next(tie), step.after, now,
                 spent_time + step.time_s, [*path, step]),
            )
    cap = f" within max_peak_bytes={max_peak_bytes}" if max_peak_bytes is not None else ""
    raise NoFeasiblePlan(f"no plan from {format_placements(src)} to {format_placements(dst)}{cap}")


def _dtype_of(itemsize: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}[itemsize]
