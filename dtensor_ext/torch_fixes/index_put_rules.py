"""`index_put` / `index_put_` (`x[idx] = v`, `x.index_put_(...)`, HF MoE routing's `inv_perm[perm] = arange(n)`).

torch 2.11 has no strategy for `aten.index_put_` at all (every MoE model stops at "does not have a sharding strategy
registered"), and its strategy for `aten.index_put` / `aten._index_put_impl_` lets `self` stay sharded on a dim the
indices address: it shards `values` the same way while the indices stay replicated, so each rank's slice of the
values meets every global position: a shape mismatch on every rank. 2.12+ register one
single-dim rule for the three ops that keeps every indexed dim of `self` whole. Here the three are given such a rule:
`self` and `values` split alike along a dim of `self` no index touches (the dim `values` has for it in the indexing
result; a broadcast size-1 or missing dim of `values` is replicated), indices replicated; or `self`, `values` and the
output all `Partial(sum)` (each rank's rows are either its own or its part of the written values, with or without
accumulate). Decided per op by a probe: whether torch's propagation refuses a `self` sharded on a dim no index
touches, or keeps `self` sharded on the dim the index addresses.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Partial, Replicate, Shard
from dtensor_ext._compat import ShardingPlaceholder as S
from dtensor_ext.rules.indexing import _follow_result_dim, _index_layout, _result_dim_of_self
from dtensor_ext.torch_fixes import applied_to, replace_rule, torch_fix, undo_all

aten = torch.ops.aten

_OPS = (aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
_NESTED_INDICES = _compat.RuntimeSchemaInfo(needs_pytree=True)  # the indices come as a list of tensors or None


def index_put_rule(op, args, kwargs):
    """Rows [out, self, *present indices, values] for `self.index_put(indices, values, accumulate)`."""
    self, indices, values = args[:3]
    indexed, rank, insert = _index_layout(self, indices)
    present = [Replicate() for _ in indexed]
    result_ndim = len(self.shape) - len(indexed) + rank  # values broadcast against self[indices]
    rows = [[S(d), S(d), *present,
             _follow_result_dim(values, _result_dim_of_self(d, indexed, rank, insert), result_ndim)]
            for d in range(len(self.shape)) if d not in indexed]
    rows.append([Partial("sum"), Partial("sum"), *present, Partial("sum")])
    return rows


@functools.cache
def _misplaces_self(op) -> bool:
    """Feature check: torch's propagation of `op` for a (4, 2) `self` indexed on dim 0 by a replicated (4,) index,
    with replicated (4, 2) values, on a 2-rank probe mesh: it refuses `self` sharded on dim 1 (which no index
    touches), or keeps `self` sharded on dim 0 (which the index addresses)."""
    index = _compat.probe_spec(torch.zeros(4, dtype=torch.int64), (Replicate(),))
    values = _compat.probe_spec(torch.zeros(4, 2), (Replicate(),))

    def placed(dim):
        self = _compat.probe_spec(torch.zeros(4, 2), (Shard(dim),))
        return _compat.output_placements(op, (self, (index,), values, False), schema_info=_NESTED_INDICES)

    return placed(1) is None or placed(0) == (Shard(0),)


@torch_fix(
    "index_put strategies",
    ops=tuple(_compat.torch_op_names(op)[0] for op in _OPS),
    why="index_put_ has no sharding strategy (every MoE model's routing stops there) and index_put keeps self "
    "sharded on an indexed dim, then fails on a shape mismatch (torch 2.11)",
)
def fix_index_put_rules():
    faulty = [op for op in _OPS if _misplaces_self(op)]
    if not faulty:
        return None
    return applied_to(faulty, undo_all([replace_rule(op, index_put_rule, schema_info=_NESTED_INDICES)
                                        for op in faulty]))
