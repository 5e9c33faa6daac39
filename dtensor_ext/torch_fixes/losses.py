"""`nll_loss` with a mean over a sharded batch: torch averages the shards' means, which is wrong or refused.

torch's `nll_loss_forward_strategy` (`torch/distributed/tensor/_ops/_math_ops.py`) keeps the batch sharded for
`reduction="mean"` and declares the output `Partial(avg)`. A shard's mean divides by that shard's total weight
(the summed class weights of its non-ignored targets), so averaging the shards' means is the global mean only when
every shard has the same total weight: with class weights or an `ignore_index` target it is a WRONG result even on
even shards, and on uneven shards torch raises instead of choosing another layout (`cross_entropy` of a batch of
2 on 4 ranks). The fix hands torch's own strategy a whole batch for a mean (the layouts it then derives gather the
batch; a Partial input stays its business) and leaves unreduced and summed losses entirely to it.
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, OpSpec, OpStrategy, Partial, Replicate, Shard
from dtensor_ext.torch_fixes import torch_fix
from dtensor_ext.torch_fixes.strategy_swap import wrap_strategies

aten = torch.ops.aten

MEAN = 1  # torch's Reduction enum: 0 none, 1 mean, 2 sum


def _unsharded(strategy: OpStrategy) -> OpStrategy:
    """The same layouts with every Shard made Replicate."""

    def whole(spec: DTensorSpec) -> DTensorSpec:
        placements = tuple(Replicate() if p.is_shard() else p for p in spec.placements)
        return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)

    return OpStrategy([OpSpec(output_specs=whole(s.output_spec)) for s in strategy.strategies])


def mean_over_the_whole_batch(torch_strategy):
    def nll_loss_forward_whole_batch_mean(op_schema: OpSchema) -> OpStrategy:
        self, target, weight, reduction, *rest = op_schema.args_schema
        if reduction != MEAN:
            return torch_strategy(op_schema)
        unsharded = OpSchema(op_schema.op, (_unsharded(self), _unsharded(target), weight, reduction, *rest),
                             op_schema.kwargs_schema, schema_info=op_schema.schema_info)
        chosen = torch_strategy(unsharded)
        sources = [s for s in (self, target, weight) if isinstance(s, OpStrategy)]
        for spec in chosen.strategies:  # costs from where the inputs really are
            spec.redistribute_cost = [_compat.redistribute_costs(s, t) for s, t in zip(sources, spec.input_specs)]
        return chosen

    return nll_loss_forward_whole_batch_mean


def _averages_shard_means(op, spatial: tuple[int, ...]) -> bool:
    """Feature check: torch declares the mean loss of a batch-sharded (4, 3, *spatial) input Partial(avg)."""
    x, target = torch.empty(4, 3, *spatial), torch.zeros(4, *spatial, dtype=torch.long)
    args = (_compat.probe_spec(x, [Shard(0)]), _compat.probe_spec(target, [Shard(0)]), None, 1, -100)
    placements = _compat.output_placements(op, args) or ()
    return any(isinstance(p, Partial) and p.reduce_op == "avg" for p in placements)


@torch_fix(
    "nll_loss mean of a sharded batch",
    ops=("aten::nll_loss_forward.default", "aten::nll_loss2d_forward.default"),
    why="a mean over a sharded batch is declared Partial(avg) of the shards' means: wrong with class weights or "
    "ignored targets, and refused on uneven shards",
)
def fix_nll_loss_mean():
    probes = {aten.nll_loss_forward.default: (), aten.nll_loss2d_forward.default: (2, 2)}
    faulty = [op for op, spatial in probes.items() if _averages_shard_means(op, spatial)]
    if not faulty:
        return None
    return wrap_strategies(faulty, mean_over_the_whole_batch)
