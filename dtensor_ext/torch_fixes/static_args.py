"""Sharding-cache keys that leave out an argument which decides the output's shape.

DTensor caches sharding propagation by the input specs plus the non-tensor arguments from the op's
`RuntimeSchemaInfo.static_argnum` on (and the keyword arguments it names in `static_kwargkey`). An argument before
`static_argnum` is not in the key: a second call that differs only there reuses the first call's output spec.

`histc(self, bins=100, min=0, max=0)` is registered with `static_argnum=2` (its strategy reads `min`/`max`), so
`bins` is left out: `histc(d, 1, 0, 8)` after `histc(d, 100, 0, 8)` returns a DTensor claiming shape (100,) around
local pieces of shape (1,). The fix keeps torch's strategy and registers it with `static_argnum=1`.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Replicate
from dtensor_ext.torch_fixes import restorer, torch_fix

aten = torch.ops.aten


@functools.cache
def _histc_reuses_bins() -> bool:
    """Feature check: `histc` of a replicated [2] DTensor on a 2-rank probe mesh, run as rank 0 with 2 bins and
    then with 1 bin, returns a second result whose claimed shape is not its local piece's."""
    with _compat.probing_dtensor_ops():
        d = _compat.probe_dtensor(torch.zeros(2), (Replicate(),), (2,))
        aten.histc.default(d, 2, 0, 1)
        out = aten.histc.default(d, 1, 0, 1)
        return out.shape != out._local_tensor.shape


@torch_fix(
    "histc cache key leaves out bins",
    ops=("aten::histc.default",),
    why="a call differing from an earlier one only in bins reuses its output spec: the DTensor claims the old "
        "bin count around pieces of the new one",
)
def fix_histc_bins():
    op = aten.histc.default
    strategy = _compat.op_strategy_func(op)
    if strategy is None or not _histc_reuses_bins():
        return None
    undo = restorer(op)
    _compat.register_op_strategy(op, strategy, schema_info=_compat.RuntimeSchemaInfo(1))
    return undo
