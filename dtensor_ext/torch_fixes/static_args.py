"""Sharding-cache keys that leave out an argument which decides the output's shape, dtype or strides.

DTensor caches sharding propagation by the input specs plus the non-tensor arguments from the op's
`RuntimeSchemaInfo.static_argnum` on and the keyword arguments named in its `static_kwargkey`. An argument left
out of the key makes a second call that differs only there reuse the first call's output spec, whose tensor
metadata then describes the first call's result:

- `histc(self, bins, min, max)`: `static_argnum=2` (its strategy reads `min`/`max`) leaves out `bins`;
  `histc(d, 1, 0, 8)` after `histc(d, 100, 0, 8)` claims shape (100,) around pieces of shape (1,).
- `topk(self, k, dim, ...)`: `static_argnum=2` leaves out `k`; `topk(d, 1, 1)` after `topk(d, 3, 1)` claims 3.
- `view.dtype(self, dtype)`: nothing is static; `d.view(torch.int16)` after `d.view(torch.float32)` claims the
  float32 shape around int16 pieces with twice the last dim.
- `multinomial(self, num_samples, replacement, *, generator)`: no schema info, so nothing is static;
  `multinomial(d, 1)` after `multinomial(d, 3)` claims 3 samples per row around pieces of 1.
- `_to_copy`, `empty_like`, `zeros_like`, `ones_like`, `full_like`: the key has `dtype` but not `memory_format`;
  `empty_like(d, memory_format=torch.channels_last)` after `empty_like(d)` claims contiguous strides.

Each fix keeps torch's strategy and only widens its key (a lower `static_argnum`, or `memory_format` added to
`static_kwargkey`). A cold call is right in every case: only the cache is at fault.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Replicate
from dtensor_ext.torch_fixes import applied_to, restorer, torch_fix, undo_all

aten = torch.ops.aten

_CHANNELS_LAST = {"memory_format": torch.channels_last}


def _static_from_1(info: _compat.RuntimeSchemaInfo) -> _compat.RuntimeSchemaInfo:
    return dataclasses.replace(info, static_argnum=min(info.static_argnum, 1))


def _with_memory_format(info: _compat.RuntimeSchemaInfo) -> _compat.RuntimeSchemaInfo:
    return dataclasses.replace(info, static_kwargkey=[*(info.static_kwargkey or []), "memory_format"])


# op -> (the wider schema info, the probe's input shape, its first call, its second call: differing only in the
# argument the key leaves out)
_KEYS: dict = {
    aten.histc.default: (_static_from_1, (2,), lambda d: aten.histc.default(d, 2, 0, 1),
                         lambda d: aten.histc.default(d, 1, 0, 1)),
    aten.topk.default: (_static_from_1, (2,), lambda d: aten.topk.default(d, 2), lambda d: aten.topk.default(d, 1)),
    aten.multinomial.default: (_static_from_1, (2,), lambda d: aten.multinomial.default(d, 2),
                               lambda d: aten.multinomial.default(d, 1)),
    aten.view.dtype: (_static_from_1, (2,), lambda d: aten.view.dtype(d, torch.float32),
                      lambda d: aten.view.dtype(d, torch.int16)),
    **{
        op: (_with_memory_format, (1, 2, 1, 2), call, lambda d, call=call: call(d, **_CHANNELS_LAST))
        for op, call in (
            (aten._to_copy.default, aten._to_copy.default),
            (aten.empty_like.default, aten.empty_like.default),
            (aten.zeros_like.default, aten.zeros_like.default),
            (aten.ones_like.default, aten.ones_like.default),
            (aten.full_like.default, lambda d, **kw: aten.full_like.default(d, 1.0, **kw)),
        )
    },
}


def _misdescribed(out) -> bool:
    outs = out if isinstance(out, tuple) else (out,)
    return any(o.shape != o._local_tensor.shape or o.stride() != o._local_tensor.stride()
               or o.dtype != o._local_tensor.dtype for o in outs)


@functools.cache
def _cache_reuses_spec(op) -> bool:
    """Feature check: `op` on a replicated DTensor of ones on a 2-rank probe mesh, run as rank 0, first called one
    way and then differing only in the argument the key leaves out, returns a second result whose claimed shape,
    strides or dtype are not its local piece's (rank 0's piece is the whole tensor). The random number generator's
    state is restored afterwards (multinomial draws)."""
    _, shape, first, second = _KEYS[op]
    with _compat.probing_dtensor_ops(), torch.random.fork_rng(devices=[]):
        d = _compat.probe_dtensor(torch.ones(shape), (Replicate(),), shape)
        first(d)
        return _misdescribed(second(d))


@torch_fix(
    "sharding cache key leaves out a shape argument",
    ops=tuple(_compat.torch_op_names(op)[0] for op in _KEYS),
    why="a call differing from an earlier one only in that argument (histc's bins, topk's k, multinomial's "
        "num_samples, view's dtype, memory_format) reuses its output spec: the DTensor claims the earlier result's shape, dtype or strides",
)
def fix_cache_keys():
    faulty = [op for op in _KEYS if _compat.registered_strategy(op) is not None and _cache_reuses_spec(op)]
    if not faulty:
        return None
    undos = []
    for op in faulty:
        undos.append(restorer(op))
        widen: Callable = _KEYS[op][0]
        _compat.set_schema_info(op, widen(_compat.schema_info(op) or _compat.RuntimeSchemaInfo()))
    return applied_to(faulty, undo_all(undos))
