"""The integer program itself: on small random problems (diamonds, tied rows sharing columns and transport blocks,
gradient reductions read by several ops and priced by their producer's choice, moved parameters held as copies, a
binding memory budget) the solve returns the cheapest plan that enumerating every plan finds, at the cost it
reports; and its LP relaxation prices a gradient reduction whole when the fractional choices split over an op's
sending candidates."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import highspy
import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

import dtensor_ext.policy.solve as solve_module
from dtensor_ext.policy import PolicyError
from dtensor_ext.policy.solve import MICROSECONDS, Problem, _model, solve

_PLACES = [(Replicate(),), (Shard(0),), (Shard(1),), (Partial(),)]


def _candidate(rng: random.Random, n_inputs: int) -> tuple:
    inputs = tuple(rng.choice(_PLACES[:3]) for _ in range(n_inputs))
    grads = tuple(rng.choice([None, *_PLACES]) for _ in range(n_inputs))
    return inputs, (rng.choice(_PLACES),), grads, rng.uniform(0, 5e-6)


def _random_problem(seed: int) -> Problem:
    """Rows 0-5 are ops (0 a source; each later op reads one or two earlier ones, so dataflow forms diamonds),
    row 4 tied to row 1 and row 5 to row 2 (the same candidates), so the edges 1 -> 2 and 4 -> 5 may share a
    block; gradient reductions over random readers, priced by the pick of a random producer row; a memory budget
    between the smallest and the largest footprint, with copies held where a moved operand is a parameter."""
    rng = random.Random(seed)
    reads = {1: [0], 2: [1, 0], 3: [2, 1], 4: [3], 5: [4, 3]}
    options = [[((), (rng.choice(_PLACES[:3]),), (), rng.uniform(0, 1e-6)) for _ in range(2)]]
    for v in range(1, 6):
        options.append([_candidate(rng, len(reads[v])) for _ in range(rng.randint(2, 3))])
    options[4] = [(((inputs[0]),), outputs, (grads[0],), cost)
                  for inputs, outputs, grads, cost in options[1]]
    options[5] = list(options[2])
    pricers: dict = {}

    def pricer(key):
        """One callable per key, as build_plan gives one per kind of value: the solve lays out a block once per
        (pricer, candidates) and prices each move once per pricer."""
        if key not in pricers:
            table = {}

            def price(p, q, g):
                if (p, q, g) not in table:
                    table[p, q, g] = 0.0 if p == q else None if rng.random() < 0.2 else rng.uniform(0, 1e-5)
                return table[p, q, g]
            pricers[key] = price
        return pricers[key]

    edges, copies = [], {}
    for v, producers in reads.items():
        for slot, u in enumerate(producers):
            if rng.random() < 0.3:
                copies[len(edges)] = [rng.choice([0, 64, 256]) for _ in options[v]]
            # the tied pair's edges price alike, as repeated layers do, and so do the two edges that row 0 feeds
            edges.append((u, 0, v, slot, pricer({(4, 5): (1, 2), (0, 2): (0, 1)}.get((u, v), (u, v)))))
    readers = [(v, slot) for v, producers in reads.items() for slot in range(len(producers))]
    # priced by the placement the value is read from, on a few levels (a reduce-scatter, an all-reduce)
    reductions = [({p: rng.choice([1e-6, 3e-6, 8e-6]) for p in _PLACES}, rng.sample(readers, rng.randint(1, 3)), 0)
                  for _ in range(3)]
    held = {v: [rng.choice([100, 400, 1600]) for _ in options[v]] for v in range(6)}
    problem = Problem(options, edges, [str(v) for v in range(6)], reductions, None, copies, {4: 1, 5: 2})
    footprints = sorted(m for _, m in _every_plan(problem, held))
    cap = footprints[len(footprints) // 3] if footprints else 1
    return Problem(options, edges, problem.names, reductions, (cap, held), copies, problem.same_as)


def _every_plan(problem: Problem, held: dict):
    """(cost, bytes held) of every plan DTensor could run: tied rows take their leader's pick, impossible moves
    rule a plan out, each reduction is paid once when any of its readers sends a Partial gradient on its dim."""
    free = [v for v in range(len(problem.options)) if v not in problem.same_as]
    for chosen in itertools.product(*(range(len(problem.options[v])) for v in free)):
        picks = dict(zip(free, chosen))
        picks.update({v: picks[leader] for v, leader in problem.same_as.items()})
        found = _cost_and_bytes(problem, held, picks)
        if found is not None:
            yield found


def _cost_and_bytes(problem: Problem, held: dict, picks) -> tuple[float, float] | None:
    option = [problem.options[v][picks[v]] for v in range(len(problem.options))]
    cost = sum(o[3] for o in option)
    nbytes = sum(held[v][picks[v]] for v in held)
    for e, (u, slot_out, v, slot_in, price) in enumerate(problem.edges):
        p, q, g = option[u][1][slot_out], option[v][0][slot_in], option[v][2][slot_in]
        moved = price(p, q, g)
        if moved is None:
            return None
        cost += moved
        if e in problem.copies and p != q:
            nbytes += problem.copies[e][picks[v]]
    read_from = {(v, slot_in): option[u][1][slot_out] for u, slot_out, v, slot_in, _ in problem.edges}
    for by_placement, readers, m in problem.reductions:
        sending = [(v, slot) for v, slot in readers
                   if option[v][2][slot] is not None and option[v][2][slot][m].is_partial()]
        if sending:  # once, at the dearest placement a sending reader reads the value from
            cost += max(by_placement[read_from[reader]] for reader in sending)
    return cost, nbytes


@pytest.mark.parametrize("budget", [True, False], ids=["budget", "no-budget"])
@pytest.mark.parametrize("seed", range(40))
def test_the_solve_finds_the_cheapest_plan_that_enumeration_finds(seed, budget):
    """Without a budget the solve first tries the LP relaxation (returned where it is integral), else the MIP."""
    problem = _random_problem(seed)
    cap, held = problem.memory
    if not budget:
        problem = replace(problem, memory=None)
        cap = math.inf
    affordable = [cost for cost, nbytes in _every_plan(problem, held) if nbytes <= cap]
    if not affordable:
        with pytest.raises(PolicyError, match="Infeasible"):
            solve(problem, "test", optimality_gap=0.0)
        return
    picks, cost, gap = solve(problem, "test", optimality_gap=0.0)
    assert gap < 1e-9
    assert all(picks[v] == picks[leader] for v, leader in problem.same_as.items())
    found = _cost_and_bytes(problem, held, picks)
    assert found is not None and found[1] <= cap
    assert found[0] == pytest.approx(cost, rel=1e-9, abs=1e-15)
    assert cost == pytest.approx(min(affordable), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("seed", range(12))
def test_a_budget_below_every_plan_is_refused_with_the_least_any_plan_holds(seed):
    """One byte under the leanest plan (found by enumeration): a PolicyError on `memory_budget` that names that
    plan's bytes as the least any plan holds; at exactly those bytes, a plan. Where no plan exists whatever the
    budget, the error is the constraints'."""
    problem = _random_problem(seed)
    _, held = problem.memory
    footprints = [nbytes for _, nbytes in _every_plan(problem, held)]
    if not footprints:
        with pytest.raises(PolicyError, match=r"^test: field '<constraints>' got .*Infeasible"):
            solve(problem, "test")
        return
    least = min(footprints)
    with pytest.raises(PolicyError, match=rf"^test: field 'memory_budget' got '{least - 1:,} B per rank'; expected at "
                                          rf"least {least:,} B per rank: .* leanest plan found holds {least:,} B\)$"):
        solve(replace(problem, memory=(least - 1, held)), "test")
    picks, _, _ = solve(replace(problem, memory=(least, held)), "test")
    assert _cost_and_bytes(problem, held, picks)[1] == least


def test_the_relaxation_pays_a_reduction_whole_when_an_ops_sending_candidates_split_it():
    """An op with two candidates that send a Partial gradient (free) and one that does not (0.9 us): the cheapest
    plan pays 0.9 us. Bounding the payment by each sending candidate alone lets the LP relaxation take both at 1/2
    and pay half a reduction (0.5 us), a bound 44% low that HiGHS must close by branching; bounding it by their sum
    makes the relaxation's optimum the plan's."""
    r, s0, p = (Replicate(),), (Shard(0),), (Partial(),)
    options = [[((), (r,), (), 0.0)],
               [((r,), (r,), (p,), 0.0), ((r,), (s0,), (p,), 0.0), ((r,), (r,), (r,), 0.9e-6)]]
    problem = Problem(options, [(0, 0, 1, 0, lambda *_: 0.0)], ["source", "op"], [({r: 1e-6}, [(1, 0)], 0)])
    picks, cost, _ = solve(problem, "test")
    assert picks[1] == 2 and cost == pytest.approx(0.9e-6)
    h, _ = _model(problem, highspy)
    n = h.getNumCol()
    h.changeColsIntegrality(n, list(range(n)), [highspy.HighsVarType.kContinuous] * n)
    h.run()
    assert h.getInfo().objective_function_value / MICROSECONDS == pytest.approx(0.9e-6)


def test_the_relaxation_prices_a_reduction_by_the_placement_its_reader_pairs_with():
    """A value is (S(0), R) or (R, S(0)) on a 2-D mesh; its reader reads it unmoved and sends a gradient Partial on
    the mesh dim where it is whole, so every plan pays one all-reduce (2 us; a reduce-scatter would be 1 us). Priced
    by the producer's and the reader's choices apart, the relaxation took each at 1/2 and paid on each mesh dim the
    reduce-scatter of the placement that dim's half did not send from (1 us in all); priced by the edge's pairs
    it pays the plan's 2 us, so the relaxation is the plan."""
    r, s0, p = Replicate(), Shard(0), Partial()
    options = [[((), ((s0, r),), (), 0.0), ((), ((r, s0),), (), 0.0)],
               [(((r, s0),), ((r, r),), ((p, s0),), 0.0), (((s0, r),), ((r, r),), ((s0, p),), 0.0)]]
    reductions = [({(s0, r): 1e-6, (r, s0): 2e-6}, [(1, 0)], 0), ({(r, s0): 1e-6, (s0, r): 2e-6}, [(1, 0)], 1)]
    problem = Problem(options, [(0, 0, 1, 0, lambda a, b, _: 0.0 if a == b else None)], ["source", "op"], reductions)
    _, cost, _ = solve(problem, "test", optimality_gap=0.0)
    assert cost == pytest.approx(2e-6)
    h, _ = _model(problem, highspy)
    n = h.getNumCol()
    h.changeColsIntegrality(n, list(range(n)), [highspy.HighsVarType.kContinuous] * n)
    h.run()
    assert h.getInfo().objective_function_value / MICROSECONDS == pytest.approx(2e-6)


def test_without_a_budget_the_relaxation_decides_where_integral_and_the_mip_where_not(monkeypatch):
    """Over the random problems without a budget both ways occur (the enumeration test checks each one's plan): an
    integral relaxation is returned with gap 0, a fractional one leaves the model to the MIP."""
    ways = []
    relaxation = solve_module._integral_relaxation

    def watched(*args):
        found = relaxation(*args)
        ways.append(found is not None)
        return found
    monkeypatch.setattr(solve_module, "_integral_relaxation", watched)
    for seed in range(40):
        problem = replace(_random_problem(seed), memory=None)
        try:
            _, _, gap = solve(problem, "test", optimality_gap=0.0)
        except PolicyError:
            continue
        if ways[-1]:
            assert gap == 0.0
    assert 0 < sum(ways) < len(ways)
