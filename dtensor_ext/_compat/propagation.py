"""DTensor's sharding propagator: its tables, rule registration, the N-D expansion of single-dim rules and
the strategy choice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._ops import OpOverload
from torch.distributed.tensor import DTensor, _sharding_prop as _sharding_prop_module
from torch.distributed.tensor._collective_utils import MeshTopoInfo, allgather_cost, allreduce_cost, reduce_scatter_cost
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo, TupleStrategy
from torch.distributed.tensor._ops import single_dim_strategy as _sds
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, Replicate
from torch.utils import _pytree as pytree

from dtensor_ext._compat.testing import outside_simulated_ranks
from dtensor_ext._compat.types import tensor_meta


_REGISTER_PARAMS = frozenset(inspect.signature(_sds.register_single_dim_strategy).parameters)


# 2.11 asserts that a rule never lists the all-Replicate row and never uses None; 2.12+ accept both.
REPLICATE_ROW_ALLOWED = "allow_uneven_sharding" in _REGISTER_PARAMS
# 2.12+: a single-dim rule may keep a layout with an empty shard (a dim smaller than its number of shards); 2.11's
# expansion drops such layouts, so a rule's op on them gathers that mesh dim first
RULES_KEEP_EMPTY_SHARDS = "allow_uneven_sharding" in _REGISTER_PARAMS


def propagator():
    return DTensor._op_dispatcher.sharding_propagator


def clear_sharding_caches() -> None:
    """Both caches must go: the Python LRU and the C++ fast path keep stale strategies otherwise."""
    propagator().propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


# Kinds of strategy torch registers for an op directly; "decomposition" is its generic fallback of last resort
# (it traces the op's decomposition and propagates through the pieces), which a direct rule takes precedence over.
DIRECT_STRATEGY_KINDS = ("single_dim", "op_strategy", "rule")


def torch_strategy_kind(op: OpOverload) -> str | None:
    """How the running torch shards `op` itself: 'single_dim', 'op_strategy', 'rule', 'decomposition' or None."""
    prop = propagator()
    if op in prop.op_single_dim_strategy_funcs:
        return "single_dim"
    if op in prop.op_strategy_funcs:
        return "op_strategy"
    if op in prop.op_to_rules:
        return "rule"
    if _has_sharding_decomposition(op):
        return "decomposition"
    return None


def _has_sharding_decomposition(op: OpOverload) -> bool:
    try:
        from torch.distributed.tensor._decompositions import DecompShardingStrategy
    except ImportError:  # torch without the decomposition fallback
        return False
    return bool(DecompShardingStrategy.has_decomp(op))


def wrap_decomposition_strategy(wrap: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Make torch's decomposition fallback (the strategy it traces through an op's decomposition, for ops with no
    strategy of their own: `(op_schema with DTensorSpec args) -> OpStrategy | None`) `wrap(torch's)`; returns the
    undo. 2.12+ hold the fallback as an object of the propagator; 2.11 calls a static method with the propagator."""
    fallback = getattr(propagator(), "decomp_strategy", None)
    if fallback is None:
        from torch.distributed.tensor._decompositions import DecompShardingStrategy

        previous_static = DecompShardingStrategy.__dict__["propagate_strategy"]

        def propagate(op_schema: OpSchema, sharding_prop) -> OpStrategy | None:
            return wrap(lambda schema: previous_static.__func__(schema, sharding_prop))(op_schema)

        DecompShardingStrategy.propagate_strategy = staticmethod(propagate)
        return lambda: setattr(DecompShardingStrategy, "propagate_strategy", previous_static)
    previous = vars(fallback).get("propagate_strategy")
    fallback.propagate_strategy = wrap(fallback.propagate_strategy)

    def undo() -> None:
        if previous is None:
            del fallback.propagate_strategy
        else:
            fallback.propagate_strategy = previous

    return undo


_REGISTRATION_TABLES = (
    "op_single_dim_strategy_funcs",
    "op_to_schema_info_for_single_dim_strategy",
    "op_strategy_funcs",
    "op_to_rules",
    "op_to_schema_info",
    "op_to_scalar_shape_adjuster",  # 2.13+; absent tables are skipped
)


def snapshot_registration(op: OpOverload) -> dict[str, Any]:
    """Everything the propagator knows about `op`, so that it can be put back exactly."""
    prop = propagator()
    return {t: getattr(prop, t)[op] for t in _REGISTRATION_TABLES if op in getattr(prop, t, {})}


def restore_registration(op: OpOverload, snapshot: dict[str, Any]) -> None:
    prop = propagator()
    for table in _REGISTRATION_TABLES:
        entries = getattr(prop, table, None)
        if entries is None:
            continue
        if table in snapshot:
            entries[op] = snapshot[table]
        else:
            entries.pop(op, None)


def single_dim_func(op: OpOverload) -> Callable | None:
    """The raw rule function registered for `op` (unwrapping torch's info record where there is one); also the rule
    a torch fix moved behind an op_strategy filter (it keeps the record as `single_dim_info`)."""
    info = propagator().op_single_dim_strategy_funcs.get(op)
    if info is None:
        info = getattr(propagator().op_strategy_funcs.get(op), "single_dim_info", None)
    if info is None:
        return None
    return getattr(info, "func", info)


def _adapt_rows_for_torch(func: Callable) -> Callable:
    """On 2.11 drop the all-Replicate row (torch adds it and asserts we did not) and refuse None entries."""
    if REPLICATE_ROW_ALLOWED:
        return func

    def adapted(op, args_meta, kwargs_meta):
        rows = []
        for row in func(op, args_meta, kwargs_meta):
            if any(p is None for p in row):
                raise NotImplementedError(f"{op}: rows with None entries need torch >= 2.12")
            if not all(isinstance(p, Replicate) for p in row):
                rows.append(row)
        return rows

    adapted.__wrapped__ = func
    return adapted


def register_single_dim(
    op: OpOverload,
    func: Callable,
    *,
    schema_info: RuntimeSchemaInfo | None = None,
    allow_uneven_sharding: bool = False,
    allow_unbacked_sharding: bool | None = None,
) -> None:
    """Register through torch's own decorator, passing only the keywords the running torch accepts."""
    wanted = {
        "schema_info": schema_info,
        "allow_uneven_sharding": allow_uneven_sharding,
        "allow_unbacked_sharding": allow_unbacked_sharding,
    }
    kwargs = {k: v for k, v in wanted.items() if k in _REGISTER_PARAMS}
    _sds.register_single_dim_strategy(op, **kwargs)(_adapt_rows_for_torch(func))


class TorchLacks(NotImplementedError):
    """The running torch lacks a capability a rule or fix needs; `needs` says which torch has it."""

    def __init__(self, what: str, needs: str):
        super().__init__(f"{what}: this torch lacks what it needs ({needs})")
        self.needs = needs


SCALAR_ADJUSTERS = "torch >= 2.13 (per-rank scalar-argument adjusters)"
OPTIONAL_TENSOR_LISTS = "torch >= 2.12 (expanding single-dim rules over tensor lists holding None, such as indices)"


def expands_optional_tensor_lists() -> bool:
    """Whether torch's N-D expansion of single-dim rules counts the tensors of a list argument that may hold None
    (`Tensor?[] indices`); 2.11 counts only whole-argument strategies, and such a rule then fails to expand."""
    probe = OpSchema(torch.ops.aten.index.Tensor, (OpStrategy([]), [None, OpStrategy([])]), {})
    return _sds._get_num_tensor_inputs(probe) == 2


def takes_optional_tensor_list(op: OpOverload) -> bool:
    return any(str(a.type) == "List[Optional[Tensor]]" for a in op._schema.arguments)


def can_adjust_scalars() -> bool:
    """Whether DTensor's propagator can rewrite shape-derived scalar args per rank (a table 2.13 added)."""
    return hasattr(propagator(), "op_to_scalar_shape_adjuster")


def register_scalar_adjuster(op: OpOverload, local_scalars: Callable) -> None:
    """Have DTensor rewrite `op`'s shape-derived scalar args for each rank's local tensors before running it.

    local_scalars(args, local_shapes) -> args, where local_shapes lists the local shape of every tensor arg.
    """
    prop = propagator()
    if not can_adjust_scalars():
        raise TorchLacks(f"{op}: rewriting scalar args per rank", SCALAR_ADJUSTERS)

    def adjust(input_specs: Sequence[DTensorSpec], schema: OpSchema) -> OpSchema:
        local_shapes = [
            compute_local_shape_and_global_offset(spec.tensor_meta.shape, spec.mesh, spec.placements)[0]
            for spec in input_specs
        ]
        return OpSchema(schema.op, tuple(local_scalars(schema.args_schema, local_shapes)), schema.kwargs_schema)

    prop.op_to_scalar_shape_adjuster[op] = adjust


VARIANT_DERIVATION = "torch >= 2.13 (in-place and out= variants derived from single-dim rules)"


def can_derive_variants() -> bool:
    """Whether DTensor derives the in-place/out/functional variants of single-dim rules (a module 2.13 added)."""
    return importlib.util.find_spec("torch.distributed.tensor._ops.autogen") is not None


def auto_register_variants() -> None:
    """Derive in-place/out/functional variants of the single-dim rules registered now; skips registered ops."""
    if not can_derive_variants():
        raise TorchLacks("deriving variants of single-dim rules", VARIANT_DERIVATION)
    from torch.distributed.tensor._ops.autogen import auto_register_op_variants

    auto_register_op_variants()


def named_variants(op: OpOverload) -> list[OpOverload]:
    """`op`'s in-place and out= overloads by ATen's naming (addmv_.default, mv.out, scatter.value_reduce_out) that
    take the same arguments besides the out= ones: what a torch that derives variants would give `op`'s rule to."""
    namespace, _, name = op._schema.name.partition("::")
    overload = op._overloadname
    inplace = getattr(getattr(getattr(torch.ops, namespace), f"{name}_", None), overload, None)
    out = getattr(op.overloadpacket, "out" if overload == "default" else f"{overload}_out", None)
    arg_names = [a.name for a in op._schema.arguments]
    return [
        v for v in (inplace, out)
        if v is not None and v._schema.is_mutable and [a.name for a in v._schema.arguments if not a.is_out] == arg_names
    ]


def op_strategy_rows(op: OpOverload, mesh, args: Sequence[Any], kwargs: dict[str, Any], placements) -> set[tuple]:
    """What torch's own strategy for `op` offers when its tensor inputs are placed as given.

    Works whether torch shards `op` with an op_strategy function or (2.14+ for cat, cumsum, scatter_add,
    logsumexp...) a single-dim rule, which is expanded over the mesh by torch's own full expansion.
    args/kwargs hold real tensors (or lists of them); placements gives one placement tuple per tensor, in
    pytree-flattened order. Returns rows (output placements..., input placements...), one placement tuple each,
    so that a rule of ours can be shown to cover everything torch's rule would pick.
    """
    placement_iter = iter(placements)

    def as_spec(x):
        if isinstance(x, torch.Tensor):
            return DTensorSpec(mesh, tuple(next(placement_iter)), tensor_meta=tensor_meta(x))
        if isinstance(x, (list, tuple)) and x and all(isinstance(e, torch.Tensor) for e in x):
            return [as_spec(e) for e in x]
        return x

    prop = propagator()
    info = prop.op_single_dim_strategy_funcs.get(op)
    schema_info = prop.op_to_schema_info_for_single_dim_strategy.get(op) if info is not None else None
    spec_schema = OpSchema(
        op, tuple(as_spec(a) for a in args), {k: as_spec(v) for k, v in kwargs.items()}, schema_info=schema_info
    )
    if info is not None:
        strategy_schema = prop._wrap_with_op_strategy(spec_schema)
        out_meta = prop._propagate_tensor_meta_non_cached(spec_schema)
        result = full_single_dim_expansion(mesh, strategy_schema, info, out_meta)(
            op, strategy_schema.args_meta, strategy_schema.kwargs_meta
        )
    else:

        def as_strategy(x):
            if isinstance(x, DTensorSpec):
                return OpStrategy([OpSpec(x)])
            if isinstance(x, list) and x and all(isinstance(e, DTensorSpec) for e in x):
                return TupleStrategy([as_strategy(e) for e in x])
            return x

        result = prop.op_strategy_funcs[op](
            OpSchema(op, tuple(as_strategy(a) for a in spec_schema.args_schema),
                     {k: as_strategy(v) for k, v in spec_schema.kwargs_schema.items()})
        )
    rows = set()
    for spec in result.strategies:
        outputs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        inputs = pytree.tree_leaves(spec.input_specs)
        rows.add(tuple(s.placements if s is not None else None for s in (*outputs, *inputs)))
    return rows


STRATEGY_VALIDATOR = "torch >= 2.12 (its strategy validator, strategy_validation.compare_operator)"


def has_strategy_validator() -> bool:
    """Whether the running torch has its strategy validator (2.11's strategy_validation module has no
    compare_operator)."""
    try:
        from torch.distributed.tensor._ops import strategy_validation
    except ImportError:
        return False
    return hasattr(strategy_validation, "compare_operator")


def compare_operator(*args, **kwargs):
    """torch's own strategy validator (2.12+): checks the rules DTensor holds for an OpInfo op on a fake group.

    A single-dim rule that a layout filter took over (an op_strategy function carrying `single_dim_info`: even
    shards only, no empty shards a kernel rejects) is validated as the rule itself: the validator checks rules
    row by row, and its op_strategy path cannot pass the filter a list of tensors (indices, tensor lists).
    """
    if not has_strategy_validator():
        raise TorchLacks("validating strategies with torch's own validator", STRATEGY_VALIDATOR)
    from torch.distributed.tensor._ops.strategy_validation import compare_operator as validate

    with _filtered_rules_as_rules():
        return validate(*args, **kwargs)


@contextlib.contextmanager
def _filtered_rules_as_rules():
    prop = propagator()
    filtered = {op: f for op, f in prop.op_strategy_funcs.items() if getattr(f, "single_dim_info", None) is not None}
    snapshots = {op: snapshot_registration(op) for op in filtered}
    for op, strategy in filtered.items():
        schema_info = prop.op_to_schema_info.get(op)
        restore_registration(op, {})
        prop.op_single_dim_strategy_funcs[op] = strategy.single_dim_info
        if schema_info is not None:
            prop.op_to_schema_info_for_single_dim_strategy[op] = schema_info
    clear_sharding_caches()
    try:
        yield
    finally:
        for op, snapshot in snapshots.items():
            restore_registration(op, snapshot)
        clear_sharding_caches()


# 2.12+: torch's expansion of single-dim rules through a prepared object, which fast propagation reuses; 2.11 has
# the expansion as one function only, so fast propagation is unavailable there.
PreparedSingleDimStrategy = getattr(_sds, "_PreparedSingleDimStrategy", None)


# torch's own N-D expansion, captured at import so that it can always be called and put back
full_single_dim_expansion = _sds._expand_single_dim_strategy_to_mesh


def single_dim_expansion() -> Callable:
    """The expansion function the propagator calls now."""
    return _sharding_prop_module._expand_single_dim_strategy_to_mesh


def set_single_dim_expansion(expand: Callable) -> None:
    """Make the propagator expand single-dim rules with `expand` (same signature as torch's); clears both caches."""
    _sharding_prop_module._expand_single_dim_strategy_to_mesh = expand
    clear_sharding_caches()


def propagate_cold(schema: OpSchema):
    """Sharding propagation for `schema` bypassing both caches (what a never-seen op signature pays)."""
    return propagator().propagate_op_sharding_non_cached(schema)


def greedy_redistribution_planned(source: DTensorSpec) -> bool:
    """True where torch prices a move away from `source` (to placements in default order, no strided shards) with
    its greedy planner: mesh dims right to left, then left to right. Fast propagation's tighter bound relies on it."""
    from torch.distributed.tensor import _redistribute

    return not getattr(_redistribute, "_FORCE_MIN_COST_REDISTRIBUTION_PLAN", True) and (
        DTensorSpec.is_default_device_order(source.shard_order)
    )


def rank_in_mesh(mesh) -> bool:
    """Whether this process is one of `mesh`'s ranks (torch prices every redistribution 0 elsewhere)."""
    return mesh._is_current_rank_part_of_mesh()


def dtensor_collective_costs():
    """torch's own cost formulas for collectives (microseconds) and its topology record, for comparison."""
    return MeshTopoInfo, {"all_gather": allgather_cost, "all_reduce": allreduce_cost,
                          "reduce_scatter": reduce_scatter_cost}


def min_cost_selector() -> Callable:
    """The function DTensor's propagator calls to pick one of an op's strategies for the given input specs."""
    return _sharding_prop_module._select_min_cost_strategy


def set_min_cost_selector(select: Callable) -> None:
    _sharding_prop_module._select_min_cost_strategy = select


def redistribute_costs(source: OpStrategy, target: DTensorSpec) -> list[float]:
    """torch's cost of moving each of `source`'s layouts to `target` (one OpSpec's redistribute_cost row)."""
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    return generate_redistribute_costs(source, target)


def op_strategy_func(op: OpOverload) -> Callable | None:
    """The op_strategy function torch registered for `op`, or None."""
    return propagator().op_strategy_funcs.get(op)


def register_op_strategy(op: OpOverload, func: Callable, *, schema_info: RuntimeSchemaInfo | None = None) -> None:
    """Register `func(strategy_schema) -> OpStrategy` as `op`'s op_strategy function in torch's table."""
    propagator().register_op_strategy(op, func, schema_info)


def expand_sharding(placements: Sequence[Placement], input_shape: Sequence[int], sizes: Sequence[int], mesh_sizes):
    """torch's view-op propagation for `expand` (input target placements, output placements); may raise."""
    from torch.distributed.tensor._ops import _view_ops

    rule = _view_ops.expand(tuple(input_shape), tuple(sizes))
    return _view_ops.propagate_shape_and_sharding(placements, tuple(input_shape), rule, tuple(mesh_sizes))


def register_view_strategy(op: OpOverload, torch_function: Callable, *, schema_info: RuntimeSchemaInfo | None) -> None:
    """Give `op` torch's view-op strategy for `torch_function`'s dim map, redistributing where a dim cannot stay
    sharded (the non-strict form torch uses for reshape and view_copy)."""
    from torch.distributed.tensor._ops import _view_ops

    _view_ops.register_op_strategy_map(op, torch_function, schema_info=schema_info, strict_view=False)


def known_equal(value: Any, constant: int) -> bool:
    """`value == constant` where that is known without guarding on a symbolic size (False where unknown)."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return bool(guard_or_false(value == constant))


def output_tensor_meta(strategy_schema: OpSchema):
    """The global output TensorMeta(s) of the op in `strategy_schema` (tensor args as OpStrategy), as torch's
    propagator computes them before expanding a single-dim rule."""
    def as_spec(x):  # (TupleStrategy is a pytree node of its own: a list argument is rebuilt by hand)
        if isinstance(x, OpStrategy):
            return x.strategies[0].output_spec
        if isinstance(x, TupleStrategy):  # a list of tensors (indices, tensor lists)
            return [as_spec(child) for child in x.children]
        if isinstance(x, (list, tuple)):  # a list with None entries stays a plain list
            return type(x)(as_spec(child) for child in x)
        return x

    args = tuple(as_spec(a) for a in strategy_schema.args_schema)
    kwargs = {k: as_spec(v) for k, v in strategy_schema.kwargs_schema.items()}
    return propagator()._propagate_tensor_meta_non_cached(OpSchema(strategy_schema.op, args, kwargs))


def local_shapes(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> list[tuple]:
    """Every rank's local shape of a tensor of global `shape` placed so on a mesh of `mesh_shape` (torch's own
    chunking, strided shards included). Computed outside simulated ranks: each coordinate is given, and under
    LocalTensorMode torch's function would otherwise run once per simulated rank for every one of them (16x the
    time; layout filters ask for every expanded layout)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    with outside_simulated_ranks():
        return [
            _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements, skip_offset=True)[0]
            for coordinate in itertools.product(*(range(n) for n in mesh_shape))
        ]


def wrap_single_dim_func(op: OpOverload, wrap: Callable[[Callable], Callable]) -> None:
    """Make `wrap(torch's rule)` the single-dim rule of `op`, keeping everything torch registered along with it
    (its uneven/unbacked sharding flags; the schema info sits in its own table and is not touched)."""
    table = propagator().op_single_dim_strategy_funcs
    info = table[op]
    table[op] = dataclasses.replace(info, func=wrap(info.func)) if dataclasses.is_dataclass(info) else wrap(info)


def registered_strategy(op: OpOverload) -> object | None:
    """What the propagator runs for `op`: its single-dim record, else its op_strategy function."""
    prop = propagator()
    return prop.op_single_dim_strategy_funcs.get(op) or prop.op_strategy_funcs.get(op)


def full_mesh_strategy_filter(prepared) -> Callable | None:
    """The rule's full-mesh filter `(mesh, op_schema, input_specs, output_specs) -> bool` (torch 2.14+), or None
    where the rule has none or the running torch has no such filters."""
    return getattr(prepared, "full_mesh_strategy_filter", None)


def schema_info(op: OpOverload) -> RuntimeSchemaInfo | None:
    """The runtime schema info torch registered with `op`'s strategy (which args are static, whether list args
    hold tensors), as DTensor's dispatcher attaches it to the OpSchema it propagates."""
    prop = propagator()
    return prop.op_to_schema_info_for_single_dim_strategy.get(op) or prop.op_to_schema_info.get(op)


def set_schema_info(op: OpOverload, info: RuntimeSchemaInfo) -> None:
    """Make `info` the runtime schema info of `op`'s strategy (in the single-dim table where its rule is single-dim),
    which decides the non-tensor arguments in DTensor's sharding-cache key."""
    prop = propagator()
    single_dim = op in getattr(prop, "op_single_dim_strategy_funcs", {})
    table = prop.op_to_schema_info_for_single_dim_strategy if single_dim else prop.op_to_schema_info
    table[op] = info


def placement_transition_cost() -> Callable | None:
    """torch's ``(src, dst, topo, mesh_dim, gb) -> (cost, gb after)`` for one step of a plan (2.13+), else None;
    fast propagation prices greedy's plan with it without re-planning."""
    from torch.distributed.tensor import _collective_utils

    return getattr(_collective_utils, "_compute_placement_transition_cost", None)


def single_dim_even_only(op: OpOverload) -> bool:
    """Whether the running torch shards `op` by a single-dim rule it declared for even shards only."""
    info = propagator().op_single_dim_strategy_funcs.get(op)
    return info is not None and getattr(info, "allow_uneven_sharding", True) is False


def single_dim_info_allowing_uneven(op: OpOverload) -> Any:
    """torch's single-dim record for `op` with uneven sharding allowed (the rule itself unchanged)."""
    return dataclasses.replace(propagator().op_single_dim_strategy_funcs[op], allow_uneven_sharding=True)
