"""Wrapping torch's strategy registrations (op_strategy functions, single-dim rules) with an exact undo."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dtensor_ext import _compat
from dtensor_ext._compat import OpOverload
from dtensor_ext.torch_fixes import Undo, restorer, undo_all


def wrap_strategies(
    ops: Iterable[OpOverload], wrap: Callable[[Callable], Callable], *, strategy_of: Callable | None = None
) -> Undo:
    """Register `wrap(torch's strategy function)` as each op's strategy, with torch's schema info for it. The
    strategy and schema info are those torch has for `strategy_of(op)` (default: the op itself)."""
    undos = []
    for op in ops:
        entry = _compat.snapshot_registration(strategy_of(op) if strategy_of else op)
        undos.append(restorer(op))
        _compat.register_op_strategy(op, wrap(entry["op_strategy_funcs"]), schema_info=entry.get("op_to_schema_info"))
    return undo_all(undos)


def wrap_single_dim_rules(ops: Iterable[OpOverload], wrap: Callable[[Callable], Callable]) -> Undo:
    """Make `wrap(torch's single-dim rule)` each op's rule; torch's flags and schema info for it stay as they are."""
    undos = []
    for op in ops:
        undos.append(restorer(op))
        _compat.wrap_single_dim_func(op, wrap)
    return undo_all(undos)
