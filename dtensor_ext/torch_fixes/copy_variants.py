"""Copying variants of view ops that torch only shards through its decomposition fallback, wrongly.

`squeeze_copy` and `unsafe_split` have no strategy of their own in torch 2.13; DTensor's decomposition fallback
(`torch/distributed/tensor/_decompositions.py`) propagates through their decompositions and then runs the real op
on each rank's local tensor:

- `squeeze_copy` (no dims) squeezes every LOCAL size-1 dim, so a rank whose shard of a sharded dim has size 1 drops
  that dim too: ranks disagree on the result's ndim (an invalid DTensor; `full_tensor()` fails). torch 2.12+
  fixed exactly this for `squeeze` by rewriting the call to `squeeze.dims` with the GLOBAL size-1 dims
  (`_sharding_prop.py`, `squeeze_op_to_dims_variant`; 2.11 has no such table). The fix gives `squeeze_copy.dim`
  torch's non-strict view strategy for `torch.squeeze` (a copy may redistribute: a squeezed size-1 dim that is
  sharded is replicated first), and a dispatch handler runs every overload as one `squeeze_copy.dim` call per
  requested dim of global size 1.
- `unsafe_split` / `unsafe_split_with_sizes` into a single piece fail with "`output_specs` has 1 output which does
  not equal the number of op outputs: 1" (the fallback returns a bare spec for a one-element list). They are
  `split` / `split_with_sizes` without view tracking, so they get torch's split strategy.

Both strategies also keep a Partial input Partial, where the fallback all-reduced it first.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Replicate, Shard
from dtensor_ext.torch_fixes import applied_to, generic_dispatch, restorer, swap_handlers, torch_fix, undo_all
from dtensor_ext.torch_fixes.strategy_swap import wrap_strategies

aten = torch.ops.aten


def _squeeze_global_size_one_dims(op_call, args, kwargs):
    """`squeeze_copy()` / `squeeze_copy(dim)` / `squeeze_copy(dims)` as `squeeze_copy.dim` calls, one per requested
    dim whose GLOBAL size is 1, last dim first (a rank's shard of another dim may have local size 1: the local
    kernel would squeeze it too); a copy where no requested dim has size 1."""
    self = args[0]
    if op_call is aten.squeeze_copy.default:
        dims = range(self.ndim)
    else:
        dims = args[1] if isinstance(args[1], (list, tuple)) else (args[1],)
    if self.ndim == 0:  # a 0-dim tensor has no dim to squeeze
        dims = ()
    out = self
    for dim in sorted({d % self.ndim for d in dims if self.shape[d] == 1}, reverse=True):
        out = generic_dispatch(aten.squeeze_copy.dim, (out, dim), {})
    return aten.clone.default(self) if out is self else out


# unsafe variant -> the view op whose strategy it shares
_UNSAFE_SPLITS = {
    aten.unsafe_split.Tensor: aten.split.Tensor,
    aten.unsafe_split_with_sizes.default: aten.split_with_sizes.default,
}


@functools.cache
def _squeeze_copy_squeezes_local_dims() -> bool:
    """Feature check: `squeeze_copy()` of a [2, 3] tensor placed Shard(0) on a 2-rank probe mesh, run as rank 0
    (local piece [1, 3]), returns a local piece with fewer dims than the DTensor claims."""
    with _compat.probing_dtensor_ops():
        out = aten.squeeze_copy.default(_compat.probe_dtensor(torch.zeros(1, 3), (Shard(0),), (2, 3)))
        return out._local_tensor.ndim != out.ndim


@functools.cache
def _refuses_single_piece(op) -> bool:
    """Feature check: torch's propagation of `op` splitting a replicated [2, 2] tensor into one piece on a 2-rank
    probe mesh fails."""
    split = 2 if op is aten.unsafe_split.Tensor else [2]
    return not _compat.propagates(op, (_compat.probe_spec(torch.zeros(2, 2), (Replicate(),)), split))


@torch_fix(
    "squeeze_copy squeezes local size-1 dims",
    ops=("aten::squeeze_copy.default", "aten::squeeze_copy.dim", "aten::squeeze_copy.dims"),
    why="a rank whose shard has size 1 drops the sharded dim: ranks disagree on ndim (invalid DTensor)",
)
def fix_squeeze_copy():
    if not _squeeze_copy_squeezes_local_dims():
        return None
    undos = [restorer(aten.squeeze_copy.dim)]  # 2.11's squeeze dim map takes one dim, not a list
    _compat.register_view_strategy(aten.squeeze_copy.dim, torch.squeeze, schema_info=_compat.RuntimeSchemaInfo(1))
    undos.append(swap_handlers(dict.fromkeys(
        (aten.squeeze_copy.default, aten.squeeze_copy.dim, aten.squeeze_copy.dims), _squeeze_global_size_one_dims
    )))
    return undo_all(undos)


@torch_fix(
    "unsafe_split through the decomposition fallback",
    ops=("aten::unsafe_split.Tensor", "aten::unsafe_split_with_sizes.default"),
    why="the fallback gives a list-returning op one output spec: 'output_specs has 1 output ... op outputs: 1'",
)
def fix_unsafe_split():
    faulty = {
        op: split
        for op, split in _UNSAFE_SPLITS.items()
        if _compat.op_strategy_func(split) is not None and _refuses_single_piece(op)
    }
    if not faulty:
        return None
    return applied_to(faulty, wrap_strategies(faulty, lambda split_strategy: split_strategy, strategy_of=faulty.get))
