"""The exact choice of one candidate per op (and one placement per parameter) on the whole mesh, by HiGHS.

Variables: x[v, k] = 1 when op v runs its candidate k (its placements on every mesh dim at once: one joint choice,
no per-dim alternation). Each dataflow edge (a producer's output read as a consumer's
input) carries a transport block y[p, q] >= 0 whose row sums equal the producer's choice of output placement p and
whose column sums equal the consumer's choice of input placement q (with the gradient placement it sends back);
y[p, q] costs the redistribution p -> q in forward plus the gradient's way back. With x integral the blocks are
exact, so the optimum is the cheapest plan among DTensor's own candidates: no relaxation, no heuristic.

Rows tied by `same_as` (an op of a middle repeated layer and its match in the second layer) share their columns:
their costs and held bytes add up on the shared columns, and edges that join the same pair of shared rows share one
transport block (with the choices equal, both blocks would carry the same move), so each tied layer adds nothing to
the model's size. Placements are numbered once and each edge's block is laid out once per distinct (pricer,
producer's candidates, consumer's candidates), so repeated layers are priced once.

Without a memory budget the LP relaxation is solved first: where its optimum is integral (as on the HF models
measured) it is the plan, proven optimal with no branching; otherwise, and under a budget, HiGHS solves the MIP.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from dtensor_ext.policy.errors import PolicyError

__all__ = ["EXACT", "Problem", "solve"]

# HiGHS sees costs in microseconds: its absolute optimality gap (1e-6 of the objective's unit) on costs in seconds
# was a whole microsecond, up to 1.7% of a tiny model's step, and let it stop at a plan that far from the optimum
MICROSECONDS = 1e6
# HiGHS's default relative optimality gap: no plan is cheaper than the one returned by more than 0.01% of its cost
EXACT = 1e-4
# a relaxed choice this close to 0 or 1 counts as integral (HiGHS's own MIP feasibility tolerance)
INTEGRAL = 1e-6


@dataclass
class Problem:
    """The whole mesh's choice. `options[v]` lists op v's candidates as (inputs, outputs, grads, unary cost),
    each placement a tuple with one entry per mesh dim; `edges` are (producer, output slot, consumer, operand slot,
    cost(p, q, g) or None where impossible)."""

    options: list[list[tuple]]
    edges: list[tuple]
    names: list[str]
    # ({the value's placement: cost}, [(op, operand slot), ...], mesh dim): paid once when any of these ops' chosen
    # candidates sends a gradient back through that slot that is Partial on that mesh dim (autograd sums the
    # partial gradients first, then one reduction into the value's placement: a reduce-scatter into a Shard costs
    # less than an all-reduce into a Replicate)
    reductions: list[tuple] = field(default_factory=list)
    # (bytes per rank, {option row: bytes held per candidate}): the memory the chosen candidates hold, capped
    memory: tuple | None = None
    # {edge index: bytes per candidate of its consumer}: what the consumer holds for backward when the edge's value
    # reaches it moved (a parameter saved as a gathered copy instead of itself), counted in the memory budget
    copies: dict = field(default_factory=dict)
    # {option row: the row whose choice it takes}: the same candidates, in the same order
    same_as: dict = field(default_factory=dict)


def _quiet_highs(highspy):
    """A HiGHS instance that prints nothing: its C++ constructor writes a banner straight to file descriptor 1
    (before any option can be set), so stdout is pointed at /dev/null while it is built."""
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
    h.setOptionValue("output_flag", False)
    return h


class _Layout:
    """One edge's transport block, its columns relative to the edge's ends: `outs` maps each output placement
    the producer's candidates send to those candidates (their indexes), `ins` each (input placement, gradient
    placement, bytes held when moved) the consumer's candidates read to those candidates; `prices` each possible
    pair (output, input) to its move's cost, `by_out`/`by_in` the pairs of each output/input in block order, and
    `copied` the moved pairs that hold bytes. Placements are numbered (`_Layouts.number`), so the keys are ints."""

    def __init__(self, outs: dict, ins: dict, price):
        self.outs, self.ins = outs, ins
        self.prices: dict[tuple, float] = {}
        self.by_out: dict = {p: [] for p in outs}
        self.by_in: dict = {qg: [] for qg in ins}
        self.copied: list[tuple] = []
        for p in outs:
            for qg in ins:
                cost = price(p, *qg[:2])
                if cost is None:  # an impossible move gets no variable: the pair cannot be chosen together
                    continue
                pair = (p, qg)
                self.prices[pair] = cost
                self.by_out[p].append(pair)
                self.by_in[qg].append(pair)
                if qg[2] and p != qg[0]:
                    self.copied.append((pair, qg[2]))


class _Layouts:
    """Edge layouts made once per distinct (price, producer's outputs, consumer's inputs): the edges of repeated
    layers (and of tied rows) reuse one, and each price is asked once per distinct (price, p, q, g). Placements
    are numbered once per option row and slot, so no placement is hashed per pair of candidates."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.numbers: dict = {None: None}  # placements -> number
        self.placements: dict = {None: None}  # number -> placements
        self.sent: dict[tuple, tuple] = {}  # (row, output slot) -> number of each candidate's output
        self.read: dict[tuple, tuple] = {}  # (row, operand slot) -> numbers of each candidate's (input, gradient)
        self.made: dict[tuple, _Layout] = {}
        self.prices: dict[tuple, float | None] = {}

    def number(self, placements) -> int | None:
        found = self.numbers.get(placements)
        if found is None and placements is not None:
            found = self.numbers[placements] = len(self.numbers)
            self.placements[found] = placements
        return found

    def of(self, e: int, u: int, slot_out: int, v: int, slot_in: int, price) -> _Layout:
        sent = self.sent.get((u, slot_out))
        if sent is None:
            sent = self.sent[u, slot_out] = tuple(self.number(o[1][slot_out]) for o in self.problem.options[u])
        read = self.read.get((v, slot_in))
        if read is None:
            read = self.read[v, slot_in] = tuple((self.number(o[0][slot_in]), self.number(o[2][slot_in]))
                                                 for o in self.problem.options[v])
        copies = self.problem.copies.get(e)
        wanted = tuple((q, g, copies[k] if copies else 0) for k, (q, g) in enumerate(read))
        key = (price, sent, wanted)
        layout = self.made.get(key)
        if layout is None:
            outs: dict = {}
            for k, p in enumerate(sent):
                outs.setdefault(p, []).append(k)
            ins: dict = {}
            for k, qg in enumerate(wanted):
                ins.setdefault(qg, []).append(k)
            layout = self.made[key] = _Layout(outs, ins, lambda p, q, g: self._price(price, p, q, g))
        return layout

    def _price(self, price, p: int, q: int, g: int | None) -> float | None:
        key = (price, p, q, g)
        if key not in self.prices:
            self.prices[key] = price(self.placements[p], self.placements[q], self.placements[g])
        return self.prices[key]


def _model(problem: Problem, highspy):
    """The HiGHS model of `problem` (costs in microseconds; the choice columns binary, the rest continuous) and the
    first column of each option row (a tied row's are its leader's)."""
    h = _quiet_highs(highspy)
    costs: list[float] = []
    first: list[int] = []
    for v, opts in enumerate(problem.options):
        leader = problem.same_as.get(v)
        first.append(len(costs) if leader is None else first[leader])
        if leader is None:
            costs += [o[3] for o in opts]
        else:
            for k, o in enumerate(opts):
                costs[first[v] + k] += o[3]
    n_choice = len(costs)
    rows: list[tuple[float, list[int], list[float]]] = []  # (rhs, columns, coefficients)
    for v, opts in enumerate(problem.options):
        if v not in problem.same_as:
            rows.append((1.0, list(range(first[v], first[v] + len(opts))), [1.0] * len(opts)))
    copied: dict[int, float] = {}  # transport column -> bytes a rank holds when that move is chosen
    shared_blocks: dict[tuple, dict] = {}  # (producer row, slot, consumer row, slot) after ties -> its block
    layouts = _Layouts(problem)
    reading: dict[tuple[int, int], dict] = {}  # (consumer row, operand slot) -> its edge's transport block
    for e, (u, slot_out, v, slot_in, price) in enumerate(problem.edges):
        layout = layouts.of(e, u, slot_out, v, slot_in, price)
        key = (problem.same_as.get(u, u), slot_out, problem.same_as.get(v, v), slot_in)
        block = shared_blocks.get(key)
        shared = block is not None and block.keys() == layout.prices.keys()
        if not shared:
            block = {pair: len(costs) + i for i, pair in enumerate(layout.prices)}
            costs += [0.0] * len(block)
            shared_blocks.setdefault(key, block)
        reading[v, slot_in] = block
        for pair, cost in layout.prices.items():
            costs[block[pair]] += cost
        for pair, nbytes in layout.copied:
            copied[block[pair]] = copied.get(block[pair], 0.0) + nbytes
        if shared:
            continue
        for ends, by_end, at in ((layout.outs, layout.by_out, first[u]), (layout.ins, layout.by_in, first[v])):
            for end, ks in ends.items():
                ys = [block[pair] for pair in by_end[end]]
                rows.append((0.0, ys + [at + k for k in ks], [1.0] * len(ys) + [-1.0] * len(ks)))
    for by_placement, readers, m in problem.reductions:
        # per reader (tied readers by their leader's row, whose columns they share): its candidates that send a
        # Partial gradient back through the slot on mesh dim m
        sending: dict[int, set[int]] = {}
        for v, slot in readers:
            for k, o in enumerate(problem.options[v]):
                if o[2][slot] is not None and o[2][slot][m].is_partial():
                    sending.setdefault(problem.same_as.get(v, v), set()).add(first[v] + k)
        if not sending:
            continue
        paid = len(costs)
        costs.append(min(by_placement.values()))
        # paid >= the sum of one reader's sending columns: at most one of an op's candidates is chosen, so the row
        # holds for integral choices as `paid >= x[v, k]` per column does, and on fractional ones it is tighter
        # (two sending candidates at 1/2 each ask for a whole payment, not half of one), which lifts the LP bound
        # HiGHS starts from (HF Llama 2x2: from 10% to 1.7% under the optimum)
        for columns in sending.values():
            rows.append((None, [paid] + sorted(columns), [1.0] + [-1.0] * len(columns)))
        # where the value's placement makes the reduction dearer, a step column per price level above the least,
        # at least each reader's transport columns that pair a placement that dear with a gradient Partial on m:
        # the pairs, not the producer's and the readers' choices apart, so that the relaxation cannot pay the cheap
        # reduction of one half-chosen placement for the gradient another half-chosen reader sends
        levels = sorted(set(by_placement.values()))
        for below, level in zip(levels, levels[1:]):
            step = len(costs)
            costs.append(level - below)
            for v, slot in readers:
                dear = [column for (p, (_, g, _)), column in reading[v, slot].items()
                        if by_placement[layouts.placements[p]] >= level
                        and layouts.placements[g] is not None and layouts.placements[g][m].is_partial()]
                if dear:
                    rows.append((None, [step] + dear, [1.0] + [-1.0] * len(dear)))
    if problem.memory is not None:
        cap, held = problem.memory
        bytes_at: dict[int, float] = dict(copied)
        for v, sizes in held.items():
            for k, b in enumerate(sizes):
                bytes_at[first[v] + k] = bytes_at.get(first[v] + k, 0.0) + b
        rows.append(("cap", list(bytes_at), list(bytes_at.values())))
    n = len(costs)
    h.addVars(n, np.zeros(n), np.ones(n))
    h.changeColsCost(n, np.arange(n), np.array(costs, dtype=float) * MICROSECONDS)
    h.changeColsIntegrality(n_choice, np.arange(n_choice), np.array([highspy.HighsVarType.kInteger] * n_choice))
    starts, indices, values = [], [], []
    for _, columns, coefficients in rows:
        starts.append(len(indices))
        indices += columns
        values += coefficients
    cap = problem.memory[0] if problem.memory is not None else 0.0
    lower = np.array([0.0 if r[0] in (None, "cap") else r[0] for r in rows])
    upper = np.array([highspy.kHighsInf if r[0] is None else cap if r[0] == "cap" else r[0] for r in rows])
    h.addRows(len(rows), lower, upper, len(indices), np.array(starts), np.array(indices), np.array(values))
    return h, first


def solve(problem: Problem, where: str, optimality_gap: float = EXACT) -> tuple[list[int], float, float]:
    """The picks (one candidate per option row), their modelled cost in seconds, and the relative gap HiGHS proved
    (at most `optimality_gap`): no plan costs less than that cost times (1 - gap)."""
    import highspy

    h, first = _model(problem, highspy)
    if problem.memory is None:
        relaxed = _integral_relaxation(h, highspy, max(first[v] + len(opts) for v, opts in enumerate(problem.options)))
        if relaxed is not None:
            # the LP's optimum is a plan: no plan is cheaper than the relaxation's optimum, so it is the MIP's (gap 0)
            return _picks(problem, first, relaxed.getSolution().col_value), relaxed.getInfo(
                ).objective_function_value / MICROSECONDS, 0.0
    h.setOptionValue("mip_rel_gap", optimality_gap)
    # LPs of the MIP by interior point (then crossover): the same optimum and proven gap, reached sooner. Its root
    # solution lets reduced-cost fixing drop more columns once a plan is found (HF Llama 2x2, 2 layers, the same
    # problem replayed, best of 2: 12.0 s with both rows and option, 59.5 s before either, HiGHS 1.16.0, same cost;
    # 8 layers under the hand plan's memory: 17.5 s, 31.8 s by simplex). A HiGHS without the option refuses it and
    # keeps its default.
    h.setOptionValue("mip_lp_solver", "ipm")
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        leanest = _leanest(h, highspy) if problem.memory is not None else None
        if leanest is not None:
            least, found = leanest
            raise PolicyError(where, "memory_budget", f"{problem.memory[0]:,} B per rank",
                              f"at least {least:,} B per rank: no plan these constraints allow holds less "
                              f"(parameters, gradients, optimizer state and saved activations; the leanest plan "
                              f"found holds {found:,} B)")
        raise PolicyError(where, "<constraints>", str(h.getModelStatus()),
                          "constraints (and a memory budget) that some plan satisfies: HiGHS found none")
    info = h.getInfo()
    return _picks(problem, first, h.getSolution().col_value), info.objective_function_value / MICROSECONDS, max(
        info.mip_gap, 0.0)


def _leanest(h, highspy, time_limit_s: float = 60.0) -> tuple[int, int] | None:
    """Where `h` (with a memory budget, its last row) has no plan: (bytes per rank no plan can hold less than, as
    HiGHS proved it, rounded up; the bytes the leanest plan it found holds), from the same model with the budget's
    row as the objective and no cap; None where no plan meets the constraints whatever the budget."""
    leanest = _quiet_highs(highspy)
    leanest.passModel(h.getModel())
    cap_row = leanest.getNumRow() - 1  # _model adds the budget's row last
    _, _, columns, bytes_held = leanest.getRowsEntries(1, np.array([cap_row]))
    n = leanest.getNumCol()
    leanest.changeColsCost(n, np.arange(n), np.zeros(n))
    leanest.changeColsCost(len(columns), columns, bytes_held)
    leanest.changeRowBounds(cap_row, 0.0, highspy.kHighsInf)
    leanest.setOptionValue("time_limit", time_limit_s)
    leanest.run()
    if leanest.getInfo().primal_solution_status != int(highspy.SolutionStatus.kSolutionStatusFeasible):
        return None  # no plan at all
    info = leanest.getInfo()
    return math.ceil(info.mip_dual_bound - 1e-6), round(info.objective_function_value)


def _integral_relaxation(h, highspy, choices: int):
    """A copy of `h` with its first `choices` columns made continuous, its LP solved by dual simplex without
    presolve; the copy where its optimum is integral (and so the MIP's optimum), else None (`h` is left as it
    was). Without a memory budget the relaxation is the plan (HF Llama 2x2, 8 layers: its LP solved in 0.5 s with
    every choice 0 or 1, where the MIP took 9.2 s, its root LP by interior point 7 s of them); under the hand
    plan's memory its choices are fractional (the budget's knapsack row), so a budgeted model goes to the MIP
    directly."""
    relaxed = _quiet_highs(highspy)
    relaxed.passModel(h.getModel())
    relaxed.changeColsIntegrality(choices, np.arange(choices),
                                  np.array([highspy.HighsVarType.kContinuous] * choices))
    relaxed.setOptionValue("presolve", "off")
    relaxed.run()
    if relaxed.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    x = np.asarray(relaxed.getSolution().col_value[:choices])
    return relaxed if np.all(np.abs(x - np.round(x)) <= INTEGRAL) else None


def _picks(problem: Problem, first: list[int], x) -> list[int]:
    """Each option row's chosen candidate in the solution `x`."""
    return [int(np.argmax([x[first[v] + k] for k in range(len(opts))])) for v, opts in enumerate(problem.options)]
