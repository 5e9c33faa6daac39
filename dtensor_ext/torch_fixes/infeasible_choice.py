"""When every strategy torch offers needs a redistribution DTensor cannot perform, fall back to Replicate.

torch's strategies for `cat`, pointwise ops and others build their candidates from the inputs' own placements
("follow input i"); with inputs laid out crosswise on a 2-D mesh, e.g. `(Shard(0), Partial)` and
`(Partial, Shard(0))`, every candidate asks some input to go from `Shard` to `Partial`. The cost model prices that
at infinity, picks one of the infinite-cost candidates anyway, and the redistribution then fails with
"redistribute from S(0) to P(sum) not supported yet" (hstack, vstack, poisson_nll_loss on a 2x2 mesh). Running
the op on replicated inputs is always a valid strategy, so where torch's pick is one of those impossible moves we
pick all-Replicate instead. Every pick torch could carry out is kept as it is, and so is every pick for an
in-place or out= op (whose result must keep its placement; those still fail as before).
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, OpSpec, Partial, Replicate, Shard
from dtensor_ext.torch_fixes import torch_fix


def _impossible(current: DTensorSpec, target: DTensorSpec) -> bool:
    """DTensor makes a Partial only out of a Replicate (and never turns one Partial kind into another)."""
    return any(
        dst.is_partial() and src != dst and not src.is_replicate()
        for src, dst in zip(current.placements, target.placements)
    )


def _replicated(spec: DTensorSpec | None) -> DTensorSpec | None:
    if spec is None:
        return None
    return DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=spec.tensor_meta)


def _all_replicate(chosen: OpSpec, inputs: list[DTensorSpec]) -> OpSpec:
    outputs = chosen.output_specs
    outputs = tuple(map(_replicated, outputs)) if isinstance(outputs, tuple) else _replicated(outputs)
    targets = [_replicated(spec) for spec in inputs]
    costs = [[_compat.redistribute_cost(spec, target)] for spec, target in zip(inputs, targets)]
    return OpSpec(output_specs=outputs, input_specs=targets, redistribute_cost=costs)


CROSSWISE = ((Shard(0), Partial()), (Partial(), Shard(0)), (Shard(0), Partial()))


@functools.cache
def _torch_picks_impossible_moves() -> bool:
    """Feature check: torch's pick for `cat` of three [4, 2] tensors laid out crosswise on a 2x2 probe mesh asks an
    input for a move DTensor cannot make."""
    op = torch.ops.aten.cat.default
    inputs = [_compat.probe_spec(torch.zeros(4, 2), placements, (2, 2)) for placements in CROSSWISE]
    schema = OpSchema(op, (inputs, 0), {}, schema_info=_compat.schema_info(op))
    with _compat.outside_simulated_ranks():
        moved = _compat.propagate_cold(schema).redistribute_schema
    if moved is None:
        return False
    return any(_impossible(spec, target) for spec, target in zip(inputs, moved.args_spec))


@torch_fix(
    "impossible redistribution chosen",
    ops=("(strategy selection of every op)",),
    why="torch picks a strategy needing Shard -> Partial when all its candidates need it; Replicate is possible",
)
def fix_impossible_choice():
    if not _torch_picks_impossible_moves():
        return None
    torch_select = _compat.min_cost_selector()

    def select(strategy, op_schema=None):
        chosen = torch_select(strategy, op_schema)
        if op_schema is None or chosen.input_specs is None:
            return chosen
        if op_schema.is_inplace_op() or op_schema.is_out_variant_op():
            # the result must keep the placement of self / out: replicating a copy of self and writing into the
            # copy left self's shards untouched under a Replicate claim (add_ in poisson_nll_loss's backward)
            return chosen
        inputs = list(op_schema.args_spec)
        if not any(_impossible(spec, target) for spec, target in zip(inputs, chosen.input_specs)):
            return chosen
        return _all_replicate(chosen, inputs)

    _compat.set_min_cost_selector(select)
    return lambda: _compat.set_min_cost_selector(torch_select)
