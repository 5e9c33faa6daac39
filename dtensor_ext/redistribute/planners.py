"""`plan(...)`: the naive, DTensor and optimal planners behind one entry point.

The optimal planner is A* over placement tuples. Moves: single mesh dim all_reduce / reduce_scatter of Partial
values, a data-moving step that changes one mesh dim's placement, and a data-moving step straight to the target
(an all-to-all over the flattened mesh dims it spans, or a pairwise permute). The heuristic is the remaining
lower bound (bytes, times the cheapest beta for the time objective), which no sequence of steps can undercut,
so the first plan popped is optimal within these moves. Steps whose buffer exceeds `max_peak_bytes` are pruned.
"""

from __future__ import annotations

import functools
import heapq
import itertools

import torch

from dtensor_ext._compat import Partial, Placement, Replicate, Shard
from dtensor_ext.redistribute.cost import IdealCostModel
from dtensor_ext.redistribute.lower_bound import lower_bound, mesh_shape_of, reduced_dims, validate_request
from dtensor_ext.redistribute.placements import format_placements
from dtensor_ext.redistribute.plan import Plan, Step
from dtensor_ext.redistribute.steps import StepBuilder, _replace

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
    options = [Replicate(), *(Shard(d) for d in range(len(builder.shape)))]
    for mesh_dim, current in enumerate(state):
        if isinstance(current, Partial):
            continue
        for p in dict.fromkeys([*options, dst[mesh_dim]]):
            if p != current and not isinstance(p, Partial):
                yield builder.exchange(state, _replace(state, mesh_dim, p))
    for mesh_dim in pending:  # an exact reduction of size-1 mesh dims (no data moves)
        if builder.mesh_shape[mesh_dim] == 1:
            yield builder.exchange(state, _replace(state, mesh_dim, Replicate()))


def _optimal(builder: StepBuilder, src, dst, max_peak_bytes, objective) -> list[Step]:
    if max_peak_bytes is not None:
        for what, placements in (("source", src), ("target", dst)):
            if builder.buffer_bytes(placements) > max_peak_bytes:
                raise NoFeasiblePlan(
                    f"max_peak_bytes={max_peak_bytes}: the {what} layout {format_placements(placements)} alone "
                    f"holds {builder.buffer_bytes(placements)} bytes on a rank"
                )
    weight = builder.cost.min_beta if objective == "time" else 1.0

    @functools.lru_cache(maxsize=None)
    def heuristic(state) -> float:
        if any(isinstance(q, Partial) and q != p and not isinstance(p, Replicate) for p, q in zip(state, dst)):
            return 0.0  # the target's Partial needs a Replicate first; no cheap bound from here
        bound = lower_bound(builder.shape, builder.mesh_shape, state, dst, dtype=_dtype_of(builder.itemsize))
        return bound.max_recv_bytes * weight

    def step_cost(step: Step) -> tuple[float, int]:
        most = max(step.recv_bytes)
        return (step.time_s if objective == "time" else most, most)

    tie = itertools.count()
    frontier = [(heuristic(src), 0, next(tie), src, 0.0, 0, [])]
    settled: dict[tuple, float] = {}
    while frontier:
        _, _, _, state, spent, spent_bytes, path = heapq.heappop(frontier)
        if state == dst:
            return path
        if settled.get(state, float("inf")) <= spent:
            continue
        settled[state] = spent
        for step in _moves(builder, state, dst):
            if step is None or step.after == state:
                continue
            if max_peak_bytes is not None and step.buffer_bytes > max_peak_bytes:
                continue
            primary, secondary = step_cost(step)
            cost, cost_bytes = spent + primary, spent_bytes + secondary
            if settled.get(step.after, float("inf")) <= cost:
                continue
            heapq.heappush(
                frontier,
                (cost + heuristic(step.after), cost_bytes, next(tie), step.after, cost, cost_bytes, [*path, step]),
            )
    cap = f" within max_peak_bytes={max_peak_bytes}" if max_peak_bytes is not None else ""
    raise NoFeasiblePlan(f"no plan from {format_placements(src)} to {format_placements(dst)}{cap}")


def _dtype_of(itemsize: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}[itemsize]
