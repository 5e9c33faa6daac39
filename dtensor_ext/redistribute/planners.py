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
from dtensor_ext.redistribute.dtensor_plan import gloo_dtensor_steps
from dtensor_ext.redistribute.lower_bound import lower_bound, mesh_shape_of, reduced_dims, validate_request
from dtensor_ext.redistribute.placements import format_placements
from dtensor_ext.redistribute.plan import Plan, Step
from dtensor_ext.redistribute.steps import StepBuilder, replace_placement

__all__ = ["PLANNERS", "OBJECTIVES", "NoFeasiblePlan", "plan"]

PLANNERS = ("naive", "dtensor", "optimal")
OBJECTIVES = ("time", "bytes")
# Planning effort allowed beyond the incumbents, counted in rank pairs examined while building steps (about 3 us
# each in CPython): deterministic, so every rank of a job stops at the same plan, whatever its load.
DEFAULT_BUDGET = 2048


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
    budget: int = DEFAULT_BUDGET,
    max_step_dims: int | None = None,
) -> Plan:
    mesh_shape = mesh_shape_of(mesh)
    shape, src, dst = validate_request(shape, mesh_shape, src, dst)
    if planner not in PLANNERS:
        raise ValueError(f"planner {planner!r}: expected one of {PLANNERS}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: expected one of {OBJECTIVES}")
    model = (cost_model or IdealCostModel()).bind(mesh_shape)
    builder = StepBuilder(shape, mesh_shape, dtype, model)
    exhaustive = True
    if planner == "dtensor":
        steps = gloo_dtensor_steps(builder, src, dst)
    elif planner == "naive":
        steps = _naive(builder, src, dst)
    else:
        steps, exhaustive = _optimal(builder, src, dst, max_peak_bytes, objective, budget, max_step_dims)
    result = Plan(
        planner, shape, mesh_shape, dtype, src, dst, tuple(steps), builder.buffer_bytes(src), builder.work, exhaustive
    )
    if planner != "optimal" and max_peak_bytes is not None and result.peak_bytes > max_peak_bytes:
        raise NoFeasiblePlan(
            f"the {planner} plan holds {result.peak_bytes} bytes on a rank, over max_peak_bytes={max_peak_bytes}"
        )
    return result


def _naive(builder: StepBuilder, src, dst) -> list[Step]:
    """All-reduce every Partial, gather everything, then keep each rank's target piece."""
    steps = _complete_partials(builder, src)
    state = steps[-1].after if steps else src
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


def _complete_partials(builder: StepBuilder, src) -> list[Step]:
    """A Partial on a size-1 mesh dim already holds the full value: relabel it Replicate, moving nothing."""
    done = tuple(Replicate() if isinstance(p, Partial) and n == 1 else p for p, n in zip(src, builder.mesh_shape))
    if done == src:
        return []
    zeros = (0,) * builder.world
    return [Step("local", (), src, done, zeros, builder.buffer_bytes(done), 0.0)]


def _dtensor_like(builder: StepBuilder, state, dst) -> list[Step] | None:
    """DTensor's way: reduce each Partial mesh dim on its own (reduce-scatter where the target shards), gather the
    changed mesh dims right to left but the leftmost, move that one in place, then split the others locally."""
    steps = []

    def to(target) -> bool:
        nonlocal state
        step = builder.exchange(state, target)
        if step is None:
            return False
        steps.append(step)
        state = target
        return True

    for mesh_dim in reduced_dims(state, dst, builder.mesh_shape):
        target = dst[mesh_dim]
        step = builder.reduce_scatter(state, mesh_dim, target.dim) if isinstance(target, Shard) else None
        steps.append(step or builder.all_reduce(state, mesh_dim))
        state = steps[-1].after
    changed = [j for j in range(len(state)) if state[j] != dst[j]]
    for mesh_dim in reversed(changed[1:]):
        if not isinstance(state[mesh_dim], Replicate) and not to(replace_placement(state, mesh_dim, Replicate())):
            return None
    for mesh_dim in changed:
        if state[mesh_dim] != dst[mesh_dim] and not to(replace_placement(state, mesh_dim, dst[mesh_dim])):
            return None
    return steps


def _gather_per_dim_then_split(builder: StepBuilder, state, dst) -> list[Step]:
    """All-reduce the Partials the target drops, gather one mesh dim at a time from the innermost (each step stays
    in one mesh dim's groups), then cut the target locally: a plan that exists for every request, also where
    steps may span one mesh dim only (a mesh without dim names)."""
    steps = []
    for mesh_dim in reduced_dims(state, dst, builder.mesh_shape):
        steps.append(builder.all_reduce(state, mesh_dim))
        state = steps[-1].after
    for mesh_dim in reversed(range(len(state))):
        if not isinstance(state[mesh_dim], (Replicate, Partial)):
            target = replace_placement(state, mesh_dim, Replicate())
            steps.append(builder.exchange(state, target))
            state = target
    if state != dst:
        steps.append(builder.exchange(state, dst))
    return steps


def _direct(builder: StepBuilder, state, dst) -> list[Step] | None:
    """One step straight to the target: a reduce_exchange where Partials are reduced, an exchange otherwise."""
    step = builder.reduce_exchange(state, dst) if reduced_dims(state, dst, builder.mesh_shape) else None
    step = step or builder.exchange(state, dst)
    return [step] if step is not None else None


def _optimal(builder: StepBuilder, src, dst, max_peak_bytes, objective, budget, max_step_dims) -> tuple[list[Step], bool]:
    """Best-first search from an incumbent; returns (steps, whether the search finished within `budget`)."""
    if max_peak_bytes is not None:
        for what, placements in (("source", src), ("target", dst)):
            if builder.buffer_bytes(placements) > max_peak_bytes:
                raise NoFeasiblePlan(
                    f"max_peak_bytes={max_peak_bytes}: the {what} layout {format_placements(placements)} alone "
                    f"holds {builder.buffer_bytes(placements)} bytes on a rank"
                )
    prefix = _complete_partials(builder, src)
    start_state = prefix[-1].after if prefix else src
    def fits(steps) -> bool:
        return all(
            (max_peak_bytes is None or s.buffer_bytes <= max_peak_bytes)
            and (max_step_dims is None or len(s.mesh_dims) <= max_step_dims)
            for s in steps
        )


    def score(received, spent_time) -> tuple[float, float]:
        return (spent_time, max(received)) if objective == "time" else (max(received), spent_time)

    def total(steps) -> tuple[float, float]:
        return score([sum(s.recv_bytes[r] for s in steps) for r in range(builder.world)] or [0], sum(s.time_s for s in steps))

    incumbents = [
        _dtensor_like(builder, start_state, dst),
        _direct(builder, start_state, dst),
        _gather_per_dim_then_split(builder, start_state, dst),
    ]
    incumbents = [steps for steps in incumbents if steps is not None and fits(steps)]
    best = min(incumbents, key=total, default=None)
    best_score = total(best) if best is not None else (float("inf"), float("inf"))

    @functools.lru_cache(maxsize=None)
    def remaining(state):
        """Lower bound from `state` to the target (None where the target's Partial needs a Replicate first)."""
        if any(isinstance(q, Partial) and q != p and not isinstance(p, Replicate) for p, q in zip(state, dst)):
            return None
        builder.work += builder.world
        return lower_bound(builder.shape, builder.mesh_shape, state, dst, dtype=builder.dtype)

    min_alpha = builder.cost.min_alpha

    def priority(state, received, spent_time) -> tuple[float, float]:
        """(what is minimised, tie-break), both never above their final values along any completion."""
        bound = remaining(state)
        if objective == "time":
            # anything left to receive takes at least one message
            ahead = bound.max_recv_bytes * builder.cost.min_beta + min_alpha if bound and bound.max_recv_bytes else 0.0
            return spent_time + ahead, max(received)
        ahead = max(max(r + n for r, n in zip(received, bound.recv_bytes_per_rank)), bound.max_recv_bytes) if bound else 0
        return max(max(received), ahead), spent_time

    tie = itertools.count()
    zero = (0,) * builder.world
    frontier = [(priority(start_state, zero, 0.0), next(tie), start_state, zero, 0.0, [])]
    settled: dict[tuple, list[tuple]] = {}
    start_work = builder.work
    while frontier:
        if builder.work - start_work > budget:
            if best is None:
                raise NoFeasiblePlan(
                    f"no plan from {format_placements(src)} to {format_placements(dst)} within max_peak_bytes="
                    f"{max_peak_bytes} found in the planning budget ({budget} rank pairs); raise `budget`"
                )
            return prefix + best, False
        head, _, state, received, spent_time, path = heapq.heappop(frontier)
        if head >= best_score:
            break
        if state == dst:
            best, best_score = path, score(received, spent_time)
            continue
        # skip a state already reached with no more received on any rank and no more time
        seen = settled.setdefault(state, [])
        if any(all(a <= b for a, b in zip(r, received)) and t <= spent_time for r, t in seen):
            continue
        seen.append((received, spent_time))
        for step in _moves(builder, state, dst):
            if builder.work - start_work > budget:
                break
            if step is None or step.after == state or not fits([step]):
                continue
            now = tuple(a + b for a, b in zip(received, step.recv_bytes))
            ahead = priority(step.after, now, spent_time + step.time_s)
            if ahead < best_score:
                heapq.heappush(frontier, (ahead, next(tie), step.after, now, spent_time + step.time_s, [*path, step]))
    if best is None:
        cap = f" within max_peak_bytes={max_peak_bytes}" if max_peak_bytes is not None else ""
        raise NoFeasiblePlan(f"no plan from {format_placements(src)} to {format_placements(dst)}{cap}")
    return prefix + best, True

