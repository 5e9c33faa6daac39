"""An expansion that runs torch's full N-D expansion and the fast search side by side, checks that the fast pick
is one the full expansion admits at its minimum cost, and hands the fast pick to DTensor."""

from __future__ import annotations

import contextlib
import math

from torch.distributed.tensor import DTensor

from dtensor_ext import _compat, fast_propagation
from dtensor_ext._compat import LocalTensor
from dtensor_ext.testing import rank_coordinates
from dtensor_ext.testing.layout import place


class CheckedExpansion:
    """Records (op, full minimum, fast cost) per propagation and fails on a pick torch's expansion does not admit."""

    def __init__(self):
        self.records: list[tuple[str, float, float]] = []

    def __call__(self, mesh, op_schema, strategy_info, output_tensor_meta):
        full = _compat.full_single_dim_expansion(mesh, op_schema, strategy_info, output_tensor_meta)
        fast = fast_propagation.expand_single_dim_strategy(mesh, op_schema, strategy_info, output_tensor_meta)

        def expanded(op, args_schema, kwargs_schema):
            admitted = full(op, args_schema, kwargs_schema).strategies
            chosen = fast(op, args_schema, kwargs_schema)
            full_min = min(total_cost(spec) for spec in admitted)
            picks = {_layout(spec) for spec in chosen.strategies}
            if len(chosen.strategies) > 1:  # the search handed the call to torch's expansion: it must be all of it
                assert picks == {_layout(spec) for spec in admitted}, f"{op}: fast propagation dropped strategies"
            else:
                assert picks <= {_layout(spec) for spec in admitted}, (
                    f"{op}: fast propagation picked {picks}, which torch's full expansion does not admit"
                )
            self.records.append((str(op), full_min, min(total_cost(spec) for spec in chosen.strategies)))
            return chosen

        return expanded

    def assert_min_cost(self, context: str) -> None:
        for name, full_min, fast_cost in self.records:
            assert math.isclose(fast_cost, full_min, rel_tol=1e-9, abs_tol=1e-12), (
                f"{name} {context}: fast propagation chose cost {fast_cost}, the full expansion's minimum is {full_min}"
            )


def total_cost(op_spec) -> float:
    return sum(c for per_input in op_spec.redistribute_cost for c in per_input)


def _layout(op_spec) -> tuple:
    outputs = op_spec.output_specs
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return (
        tuple(None if s is None else tuple(s.placements) for s in outputs),
        tuple(tuple(s.placements) for s in op_spec.input_specs or ()),
    )


@contextlib.contextmanager
def expansion(expand):
    """DTensor expands single-dim rules with `expand` inside the block (both sharding caches cleared)."""
    previous = _compat.single_dim_expansion()
    _compat.set_single_dim_expansion(expand)
    try:
        yield expand
    finally:
        _compat.set_single_dim_expansion(previous)


def as_dtensor(tensor, mesh, placements, salt):
    """A DTensor whose ranks hold `tensor` under `placements`, Partial included (built from per-rank pieces)."""
    pieces = place(tensor, placements, tuple(mesh.shape), rank_coordinates(mesh), salt=salt)
    return DTensor.from_local(
        LocalTensor(pieces), mesh, placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )
