"""Fast sharding propagation: DTensor's cheapest N-D strategy for a single-dim rule, without enumerating S^N.

torch expands a single-dim rule (S rows for one mesh dim) to an N-D mesh by pricing all S^N combinations of rows,
about a second per op on a 4-D mesh. The price of a combination is a sum over inputs of torch's
``redistribute_cost(source, target)``, and it has a lower bound that splits per mesh dim: where an input's target
differs from a Shard or Partial source on a mesh dim, every plan takes a first collective step out of that
source there, which costs at least that collective at the fewest bytes the input can hold at that moment
(:class:`_LeaveBound`). Combinations of price classes of rows are visited in order of increasing bound (a k-best
walk over per-mesh-dim sorted classes); each is first checked against a whole-move bound (where torch plans
greedily, greedy's own plan priced with torch's per-step cost: the price itself) and only a combination that
would beat the best found is priced with torch's own cost function (once per input and target). The walk stops
when the bound reaches the best price found: nothing unvisited is cheaper. The chosen strategy's cost is the full
expansion's minimum (to float rounding, 2e-12 relative); among equal-cost strategies the pick may differ.

Where an assumption of that argument cannot be checked (strided shards, symbolic shapes, tensors inside lists or
passed as keywords, arguments on other meshes, ranks outside the mesh, foreach ops, rows with unplaced inputs)
the call goes to torch's full expansion unchanged, as it does when no finite-cost combination is found.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import (
    DTensorSpec,
    OpSpec,
    OpStrategy,
    Partial,
    Placement,
    Replicate,
    TensorMeta,
    TupleStrategy,
)

__all__ = ["enable", "disable", "is_enabled", "fast_propagation", "expand_single_dim_strategy", "min_cost_strategy"]

# The walk stops once the bound is within this factor of the best price: a few float roundings separate a bound
# from the price it bounds (~1e-15 relative), so what is left unvisited costs at least the best minus 2e-12
# relative; stopping at ties is what makes a bound that is exact on equal-cost combinations pay off.
_TIE = 1.0 - 1e-12

_REPLICATE = Replicate()

_previous_expansion: list[Callable] = []


def is_enabled() -> bool:
    return _compat.single_dim_expansion() is expand_single_dim_strategy


def enable() -> None:
    """Route DTensor's expansion of single-dim rules through the fast search (idempotent). On a torch without
    prepared single-dim strategies (2.11) the search cannot run: torch's full expansion keeps deciding, and a
    warning says so."""
    if is_enabled():
        return
    if _compat.PreparedSingleDimStrategy is None:
        warnings.warn("fast propagation needs torch's prepared single-dim strategies (torch 2.12+); on this torch "
                      "DTensor's full expansion keeps deciding every op", stacklevel=2)
    _previous_expansion.append(_compat.single_dim_expansion())
    _compat.set_single_dim_expansion(expand_single_dim_strategy)


def disable() -> None:
    """Put back exactly the expansion that was there before :func:`enable` (idempotent)."""
    if not is_enabled():
        return
    _compat.set_single_dim_expansion(_previous_expansion.pop())


@contextlib.contextmanager
def fast_propagation() -> Iterator[None]:
    """Fast propagation inside the block; the previous state afterwards."""
    was_enabled = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()


def expand_single_dim_strategy(mesh, op_schema, strategy_info, output_tensor_meta) -> Callable:
    """Drop-in for torch's ``_expand_single_dim_strategy_to_mesh``: returns ``(op, args, kwargs) -> strategy``."""
    if not _search_applies(mesh, op_schema, strategy_info, output_tensor_meta):
        return _compat.full_single_dim_expansion(mesh, op_schema, strategy_info, output_tensor_meta)

    def expanded_strategy(op, args_schema, kwargs_schema):
        found = min_cost_strategy(mesh, op_schema, strategy_info, output_tensor_meta)
        if found is not None:
            return found
        full = _compat.full_single_dim_expansion(mesh, op_schema, strategy_info, output_tensor_meta)
        return full(op, args_schema, kwargs_schema)

    return expanded_strategy


def _search_applies(mesh, op_schema, strategy_info, output_tensor_meta) -> bool:
    """True where every assumption of the bound holds; otherwise torch's full expansion decides."""
    if _compat.PreparedSingleDimStrategy is None:
        return False
    if getattr(strategy_info, "different_mesh_args", None):
        return False
    if not _compat.rank_in_mesh(mesh):
        return False  # torch prices every redistribution 0 there; the bound would not hold
    if any(_holds_tensor(v) for v in op_schema.kwargs_schema.values()):
        return False
    inputs = []
    for arg in op_schema.args_schema:
        if isinstance(arg, _compat.OpStrategy):
            inputs.append(arg)
        elif _holds_tensor(arg):
            return False  # tensor lists / tuples and foreach ops
    if not inputs:
        return False
    for strategy in inputs:
        if len(strategy.strategies) != 1:
            return False
        spec = strategy.strategies[0].output_spec
        if spec.mesh != mesh or spec.tensor_meta is None or spec.shard_order is None:
            return False
        if any(isinstance(p, _compat.StridedShard) for p in spec.placements):
            return False
        if _symbolic(spec.tensor_meta):
            return False
    metas = [output_tensor_meta] if isinstance(output_tensor_meta, TensorMeta) else output_tensor_meta or []
    return not any(m is not None and _symbolic(m) for m in metas)


def _holds_tensor(obj) -> bool:
    if isinstance(obj, (OpStrategy, TupleStrategy)):
        return True
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(o) for o in obj)
    return False


def _symbolic(meta: TensorMeta) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*meta.shape, *meta.stride))


def min_cost_strategy(mesh, op_schema, strategy_info, output_tensor_meta) -> OpStrategy | None:
    """The cheapest combination as a one-entry OpStrategy, or None where the full expansion must decide."""
    if not _search_applies(mesh, op_schema, strategy_info, output_tensor_meta):
        return None
    prepared = _compat.PreparedSingleDimStrategy(strategy_info, op_schema, output_tensor_meta)
    sources = [s.strategies[0].output_spec for s in op_schema.args_strategy]
    rows = prepared.expanded_strategies
    num_outputs = prepared.num_outputs
    if len(sources) != prepared.num_inputs or not rows:
        return None
    if any(p is None for row in rows for p in row[num_outputs:]):
        return None  # inputs without a spec: torch's bookkeeping for them is not modelled here
    if any(isinstance(p, _compat.StridedShard) for row in rows for p in row):
        return None  # strided targets send torch's pricing to its graph planner, which the bound does not model
    for pos in range(num_outputs):
        if len({row[pos] is None for row in rows}) > 1:
            return None
    search = _Search(mesh, op_schema, prepared, sources, output_tensor_meta)
    return search.run()


class _Search:
    """Best-first walk over row combinations in order of a per-mesh-dim admissible cost bound."""

    def __init__(self, mesh, op_schema, prepared, sources: list[DTensorSpec], output_tensor_meta):
        self.mesh = mesh
        self.op_schema = op_schema
        self.prepared = prepared
        # torch (2.14+) drops full-mesh combinations a rule's filter rejects (e.g. mean: Partial(avg) of uneven
        # shards); filtering only removes candidates, so the bound stays admissible for what is left
        self.admits = _compat.full_mesh_strategy_filter(prepared)
        self.sources = sources
        self.num_outputs = prepared.num_outputs
        self.output_tensor_meta = output_tensor_meta
        self.priced: dict[tuple[int, tuple[Placement, ...]], tuple[DTensorSpec, float] | None] = {}
        self.lowers: dict[tuple[int, tuple[Placement, ...]], float] = {}
        topo = _compat.MeshTopoInfo.build_from_mesh(mesh)
        self.bounds = [
            _LeaveBound(mesh, topo, source, _shard_dims(prepared.expanded_strategies, self.num_outputs + k))
            for k, source in enumerate(sources)
        ]
        self.rows_per_dim = [self._ranked_rows(op_schema, dim) for dim in range(mesh.ndim)]

    def _ranked_rows(self, op_schema, dim: int) -> list[tuple[float, list[Sequence]]]:
        """(bound, rows of one price class) for the rows allowed on mesh dim `dim`, cheapest bound first, the
        no-change class first.

        Rows whose input targets differ only where an input is Replicate on `dim` and the target is Replicate or
        a Partial are one class: greedy then takes no step or a free local one there, which changes no byte count
        and no nesting check, so every combination of a class costs the same. The walk prices one per class.
        """
        rows = self.prepared.expanded_strategies
        source_here = tuple(spec.placements[dim] for spec in self.sources)
        if _is_inplace(op_schema.op):
            # the result IS self: self may not move and the output must keep self's placement
            own = source_here[0]
            rows = [r for r in rows if r[self.num_outputs] == own and r[0] in (None, own)]
        free = [
            src.is_replicate() and bound.greedy and bound.step_cost is not None
            for src, bound in zip(source_here, self.bounds)
        ]
        classes: dict[tuple, list[Sequence]] = {}
        for row in rows:
            targets = row[self.num_outputs :]
            key = tuple(None if is_free and not dst.is_shard() else dst for is_free, dst in zip(free, targets))
            classes.setdefault(key, []).append(row)
        ranked = []
        for members in classes.values():
            members.sort(key=lambda row: tuple(row[self.num_outputs :]) != source_here)  # staying put first
            targets = tuple(members[0][self.num_outputs :])
            bound = sum(b.leave(dim, dst) for b, dst in zip(self.bounds, targets))
            ranked.append((bound, targets != source_here, members))
        ranked.sort(key=lambda item: (item[0], item[1]))
        return [(bound, members) for bound, _, members in ranked]

    def run(self) -> OpStrategy | None:
        best_cost, best_combo = float("inf"), None
        for bound, classes in self._combinations():
            if bound >= best_cost * _TIE:
                break
            if self._lower(tuple(members[0] for members in classes)) >= best_cost * _TIE:
                continue  # greedy's priced plan already rules the class out: no call to torch's cost function
            for combo in itertools.product(*classes):
                cost = self._price(combo)
                if cost is not None:  # the first combination of the class torch admits: all cost the same
                    if cost < best_cost:
                        best_cost, best_combo = cost, combo
                    break
        if best_combo is None:
            return None
        return OpStrategy([self._op_spec(best_combo)])

    def _combinations(self) -> Iterator[tuple[float, tuple[list[Sequence], ...]]]:
        """Every combination of one class per mesh dim, in nondecreasing order of the summed bound.

        Each index vector has one parent (its last nonzero index lowered by one), so a heap seeded with the zero
        vector yields each combination once.
        """
        ranked = self.rows_per_dim
        if any(not rows for rows in ranked):
            return
        start = (0,) * len(ranked)
        heap = [(sum(rows[0][0] for rows in ranked), start)]
        while heap:
            bound, index = heapq.heappop(heap)
            yield bound, tuple(ranked[d][i][1] for d, i in enumerate(index))
            last = max((d for d, i in enumerate(index) if i), default=0)
            for d in range(last, len(index)):
                if index[d] + 1 < len(ranked[d]):
                    child = index[:d] + (index[d] + 1,) + index[d + 1 :]
                    heapq.heappush(heap, (sum(rows[i][0] for rows, i in zip(ranked, child)), child))

    def _lower(self, combo: tuple[Sequence, ...]) -> float:
        """Sum of the inputs' whole-move bounds (:meth:`_LeaveBound.lower`), each computed once per target."""
        total = 0.0
        for k, bound in enumerate(self.bounds):
            target = tuple(row[self.num_outputs + k] for row in combo)
            key = (k, target)
            if key not in self.lowers:
                self.lowers[key] = bound.lower(target)
            total += self.lowers[key]
        return total

    def _price(self, combo: tuple[Sequence, ...]) -> float | None:
        """torch's total redistribute cost of this combination, or None where torch's expansion drops it."""
        placements = list(zip(*combo))  # per output/input position: its placement on each mesh dim
        if any(p[0] is not None and _mixed_partials(p) for p in placements):
            return None
        priced = [self._priced_input(k, placements[self.num_outputs + k]) for k in range(len(self.sources))]
        if any(p is None for p in priced):
            return None
        if self.admits is not None and self.num_outputs:
            outputs = self._output_specs(placements)
            if outputs is not None and not self.admits(self.mesh, self.op_schema, [s for s, _ in priced], outputs):
                return None
        return sum(cost for _, cost in priced)  # torch's order of summing: equal combinations give equal totals

    def _priced_input(self, k: int, target: tuple[Placement, ...]) -> tuple[DTensorSpec, float] | None:
        """(spec, cost) of moving input `k` to `target`, or None where torch deems the target unshardable."""
        key = (k, target)
        if key not in self.priced:
            source = self.sources[k]
            spec = DTensorSpec(self.mesh, target, tensor_meta=source.tensor_meta)
            shardable = _compat.is_tensor_shardable(
                source.tensor_meta.shape, spec, allow_unbacked_sharding=self.prepared.allow_unbacked_sharding
            ) or (self.prepared.allow_uneven_sharding and source.placements == target)
            self.priced[key] = (spec, _compat.redistribute_cost(source, spec)) if shardable else None
        return self.priced[key]

    def _op_spec(self, combo: tuple[Sequence, ...]) -> OpSpec:
        placements = list(zip(*combo))
        priced = [self._priced_input(k, placements[self.num_outputs + k]) for k in range(len(self.sources))]
        return OpSpec(
            output_specs=self._output_specs(placements),
            input_specs=[spec for spec, _ in priced],
            redistribute_cost=[[cost] for _, cost in priced],
        )

    def _output_specs(self, placements):
        """Output specs with torch's pairing of output positions and tensor metas (None outputs skip a meta)."""
        metas = self.output_tensor_meta
        specs, seen = [], 0
        for pos in range(self.num_outputs):
            if placements[pos][0] is None:
                specs.append(None)
                continue
            if isinstance(metas, TensorMeta) or metas is None:
                meta = metas
            else:
                meta = metas[seen] if seen < len(metas) else None
            seen += 1
            specs.append(DTensorSpec(self.mesh, placements[pos], tensor_meta=meta))
        if self.num_outputs == 0:
            return None
        list_output = self.op_schema.return_type_list_tensor_like() and not (
            metas is None or isinstance(metas, TensorMeta)
        )
        return tuple(specs) if self.num_outputs > 1 or list_output else specs[0]


class _LeaveBound:
    """Least redistribute cost an input pays on one mesh dim for leaving its source placement there.

    On a mesh dim whose source is a Shard or Partial and whose target differs, every plan takes a first step out
    of the source there (Shard: all-gather or all-to-all; Partial: all-reduce or reduce-scatter), and its price is
    at least the collective's at the fewest bytes the input can hold then. Planner-agnostically that is a shard
    on every mesh dim; with torch's greedy planner (right to left, then left to right) it is a shard only on the
    mesh dims that can be sharded at that moment, which is what makes the bound tight.
    """

    def __init__(self, mesh, topo, source: DTensorSpec, shard_dims: frozenset[int]):
        self.mesh, self.topo, self.source = mesh, topo, source
        self.shard_dims = shard_dims  # tensor dims the rule ever shards this input on
        meta = source.tensor_meta
        self.total_gb = meta.dtype.itemsize * math.prod(meta.shape) / 1024**3
        self.greedy = _compat.greedy_redistribution_planned(source)
        self.right_to_left_first = source.num_shards > 1  # greedy's first pass runs only then
        self.step_cost = _compat.placement_transition_cost()
        self.bytes_gb = meta.dtype.itemsize * math.prod(meta.shape) / source.num_shards / 1024 / 1024 / 1024

    def lower(self, target: Sequence[Placement]) -> float:
        """A bound on the whole move to `target`: where torch plans it greedily, greedy's own plan priced with
        torch's per-step cost (so the bound is the price); otherwise the sum of the per-mesh-dim leave bounds."""
        if self.greedy and self.step_cost is not None:
            return self._greedy_price(target)
        return sum(self.leave(dim, dst) for dim, dst in enumerate(target))

    def _greedy_price(self, target: Sequence[Placement]) -> float:
        """Greedy's steps: right to left (only for a sharded source), a kept or new ``Shard(d)`` on mesh dim j
        turned into Replicate where the mesh dims before j (untouched then) shard d differently in source and
        target; then left to right to the target. Each step is priced in order, carrying the bytes it leaves."""
        if self.source.is_replicated():
            return 0.0
        placements = self.source.placements
        current = list(placements)
        steps = []
        if self.right_to_left_first:
            for dim in reversed(range(len(target))):
                dst = target[dim]
                if dst.is_shard() and any(
                    placements[i].is_shard(dst.dim) != target[i].is_shard(dst.dim) for i in range(dim)
                ):
                    dst = _REPLICATE
                if current[dim] != dst:
                    steps.append((dim, current[dim], dst))
                    current[dim] = dst
        steps.extend((dim, current[dim], dst) for dim, dst in enumerate(target) if current[dim] != dst)
        cost, gb = 0.0, self.bytes_gb
        for dim, src, dst in steps:
            step, gb = self.step_cost(src, dst, self.topo, dim, gb)
            if step == math.inf:
                return math.inf
            cost += step
        return cost

    def leave(self, dim: int, dst: Placement) -> float:
        src = self.source.placements[dim]
        if src == dst or not (src.is_shard() or src.is_partial()):
            return 0.0
        gb = self.total_gb / self._most_shards(dim, src, dst)
        if src.is_shard():
            gather = _compat.allgather_cost(gb * self.mesh.size(dim), self.topo, dim)
            all_to_all = _compat.allgather_cost(gb, self.topo, dim) + 1.0
            if not self.greedy:
                return min(gather, all_to_all)
            if dst.is_replicate():
                return gather
            if dst.is_partial():
                return math.inf  # greedy steps straight there, and torch prices Shard -> Partial infinite
            return all_to_all if self._steps_straight_to_shard(dim) else min(gather, all_to_all)
        reduce, reduce_scatter = (f(gb, self.topo, dim) for f in (_compat.allreduce_cost, _compat.reduce_scatter_cost))
        if not self.greedy:
            return min(reduce, reduce_scatter)
        if dst.is_replicate():
            return reduce
        if dst.is_partial():
            return math.inf  # torch prices a change of Partial kind infinite
        return reduce_scatter if self._steps_straight_to_shard(dim) else min(reduce, reduce_scatter)

    def _steps_straight_to_shard(self, dim: int) -> bool:
        """Greedy goes straight to a Shard target unless its right-to-left pass finds other nesting before `dim`."""
        return dim == 0 or not self.right_to_left_first

    def _most_shards(self, dim: int, src: Placement, dst: Placement) -> int:
        """How many shards the input can be split in when its first step on `dim` runs."""
        sizes = self.mesh.shape
        if not self.greedy:
            return math.prod(sizes)
        placements = self.source.placements
        if not self.right_to_left_first:
            # left to right only: the mesh dims before `dim` may hold their targets, the later ones their sources
            earlier = math.prod(sizes[i] for i in range(dim) if self.shard_dims)
            return earlier * math.prod(sizes[i] for i in range(dim, len(sizes)) if placements[i].is_shard())
        # right to left first: the mesh dims before `dim` are untouched; a later one is sharded on tensor dim d only
        # if the nesting of d over the mesh dims before it is the same in source and target, so not on a d that
        # `src` or `dst` shards on `dim` (exactly one of them does)
        moving = {p.dim for p in (src, dst) if p.is_shard()}
        later = math.prod(sizes[i] for i in range(dim + 1, len(sizes)) if self.shard_dims - moving)
        return math.prod(sizes[i] for i in range(dim + 1) if placements[i].is_shard()) * later


def _shard_dims(rows, position: int) -> frozenset[int]:
    return frozenset(row[position].dim for row in rows if row[position] is not None and row[position].is_shard())


def _mixed_partials(placements: tuple[Placement, ...]) -> bool:
    """torch drops a spec with two kinds of Partial, except sum with avg of the same Partial type."""
    kinds = {(type(p), p.reduce_op) for p in placements if isinstance(p, Partial)}
    if len(kinds) <= 1:
        return False
    return not (len({t for t, _ in kinds}) == 1 and {op for _, op in kinds} == {"sum", "avg"})


def _is_inplace(op) -> bool:
    return op.name().split("::")[1].split(".")[0].endswith("_")
