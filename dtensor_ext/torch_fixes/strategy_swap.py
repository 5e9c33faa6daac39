"""Wrapping torch's strategy registrations (op_strategy functions, single-dim rules) with an exact undo."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpOverload, OpSchema, OpSpec, OpStrategy, pytree
from dtensor_ext.torch_fixes import Undo, restorer, undo_all


def wrap_strategies(
    ops: Iterable[OpOverload], wrap: Callable[[Callable], Callable], *, strategy_of: Callable | None = None,
    schema_info: _compat.RuntimeSchemaInfo | None = None,
) -> Undo:
    """Register `wrap(torch's strategy function)` as each op's strategy, with torch's schema info for it (or
    `schema_info`, where the wrapper reads a static argument torch's strategy ignores). The strategy and schema
    info are those torch has for `strategy_of(op)` (default: the op itself)."""
    ops = list(ops)
    entries = {op: _compat.snapshot_registration(strategy_of(op) if strategy_of else op) for op in ops}
    for op, entry in entries.items():  # checked before anything changes: a refusal leaves torch as it was
        if "op_strategy_funcs" not in entry:
            kind = _compat.torch_strategy_kind(strategy_of(op) if strategy_of else op)
            raise _compat.TorchLacks(f"{op}: wrapping its strategy function",
                                     f"a torch sharding it with an op_strategy (2.12+); this one has {kind}")
    undos = []
    for op, entry in entries.items():
        undos.append(restorer(op))
        _compat.register_op_strategy(
            op, wrap(entry["op_strategy_funcs"]), schema_info=schema_info or entry.get("op_to_schema_info")
        )
    return undo_all(undos)


def wrap_single_dim_rules(ops: Iterable[OpOverload], wrap: Callable[[Callable], Callable]) -> Undo:
    """Make `wrap(torch's single-dim rule)` each op's rule; torch's flags and schema info for it stay as they are."""
    undos = []
    for op in ops:
        undos.append(restorer(op))
        _compat.wrap_single_dim_func(op, wrap)
    return undo_all(undos)


def expand_single_dim(info: object, op_schema: OpSchema, expand: Callable | None = None) -> OpStrategy:
    """The single-dim rule `info` (torch's registration record) expanded over the mesh of `op_schema`, by
    `expand` or else the expansion the propagator uses now (fast propagation swaps it)."""
    expand = expand or _compat.single_dim_expansion()
    mesh = op_schema.args_strategy[0].mesh
    output_meta = _compat.output_tensor_meta(op_schema)
    return expand(mesh, op_schema, info, output_meta)(op_schema.op, op_schema.args_meta, op_schema.kwargs_meta)


def single_dim_as_op_strategy(
    op: OpOverload, strategy_for: Callable[[object], Callable[[OpSchema], OpStrategy]]
) -> Undo:
    """Put `strategy_for(the op's single-dim rule record)` (an op_strategy function expanding that rule itself, see
    `expand_single_dim`) in place of the rule, with its schema info; the undo puts the registration back."""
    snapshot = _compat.snapshot_registration(op)
    rule = snapshot["op_single_dim_strategy_funcs"]
    strategy = strategy_for(rule)
    strategy.single_dim_info = rule  # stays discoverable: _compat.single_dim_func
    _compat.restore_registration(op, {})
    _compat.register_op_strategy(
        op, strategy, schema_info=snapshot.get("op_to_schema_info_for_single_dim_strategy")
    )
    return lambda: _compat.restore_registration(op, snapshot)


def filtered_single_dim(info: object, keeps: Callable[[OpSchema], Callable[[OpSpec], bool]]) -> Callable:
    """An op_strategy function: the single-dim rule `info` expanded over the mesh as DTensor would (fast
    propagation included), keeping only the layouts `keeps(op_schema)` accepts (all-Replicate must be one).

    A single-dim rule cannot see the mesh, so the filter sits after the expansion; where the expansion in use
    returns only its cheapest pick and the filter drops it, torch's full expansion supplies the alternatives.
    """

    def kept(offered: OpStrategy, op_schema: OpSchema) -> OpStrategy:
        accepts = keeps(op_schema)
        return OpStrategy([s for s in offered.strategies if accepts(s)])

    def strategy(op_schema: OpSchema) -> OpStrategy:
        if any(len(s.strategies) != 1 for s in op_schema.args_strategy):
            return _queried_without_a_layout(op_schema)
        expand = _compat.single_dim_expansion()
        offered = expand_single_dim(info, op_schema, expand)
        runnable = kept(offered, op_schema)
        if len(runnable.strategies) == len(offered.strategies):
            return offered
        if not runnable.strategies and expand is not _compat.full_single_dim_expansion:
            runnable = kept(expand_single_dim(info, op_schema, _compat.full_single_dim_expansion), op_schema)
        return runnable

    def _queried_without_a_layout(op_schema: OpSchema) -> OpStrategy:
        """Tools (torch's strategy_validation) ask with every candidate layout of each input at once, which torch's
        expansion refuses: expand for one candidate per input (a sharded one where there is one: the rows depend
        only on which shard types the inputs use), filter, and price each row against all candidates."""
        sources = op_schema.args_strategy

        def one_candidate(source: OpStrategy) -> OpStrategy:
            sharded = [s for s in source.strategies if any(hasattr(p, "dim") for p in s.output_spec.placements)]
            return OpStrategy((sharded or source.strategies)[:1])

        chosen = pytree.tree_map_only(OpStrategy, one_candidate, (op_schema.args_schema, op_schema.kwargs_schema))
        offered = strategy(OpSchema(op_schema.op, *chosen, schema_info=op_schema.schema_info))
        return OpStrategy([
            OpSpec(spec.output_specs, spec.input_specs, [
                [_compat.redistribute_cost(s.output_spec, target) for s in source.strategies]
                for source, target in zip(sources, spec.input_specs)
            ])
            for spec in offered.strategies
        ])

    return strategy


def input_spec(spec: OpSpec, index: int) -> DTensorSpec:
    """The layout `spec` wants for its `index`-th tensor input (a spec listing none wants the output's)."""
    return spec.input_specs[index] if spec.input_specs else spec.output_spec


def strategy_for_moved_inputs(
    torch_strategy: Callable, op_schema: OpSchema, targets: dict[int, DTensorSpec]
) -> OpStrategy:
    """`torch_strategy` asked as if the tensor argument at each position of `targets` were laid out as its target,
    each layout it offers priced as the moves from where those inputs really are."""
    args = list(op_schema.args_schema)
    for position, target in targets.items():
        args[position] = OpStrategy([OpSpec(target)])
    moved_schema = OpSchema(op_schema.op, tuple(args), op_schema.kwargs_schema, schema_info=op_schema.schema_info)
    tensor_positions = [i for i, arg in enumerate(op_schema.args_schema) if isinstance(arg, OpStrategy)]

    def priced(spec: OpSpec) -> OpSpec:
        costs = list(spec.redistribute_cost)
        for index, position in enumerate(tensor_positions):
            if position in targets:  # a slice, so a cost list torch left short gets this input's costs appended
                costs[index:index + 1] = [[_compat.redistribute_cost(s.output_spec, input_spec(spec, index))
                                           for s in op_schema.args_schema[position].strategies]]
        return OpSpec(spec.output_specs, spec.input_specs, costs)

    return OpStrategy([priced(spec) for spec in torch_strategy(moved_schema).strategies])
