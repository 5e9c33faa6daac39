"""Opt-in: views that no layout can alias return a redistributed copy instead of raising.

torch's strict view strategy (`torch/distributed/tensor/_ops/_view_ops.py`, `strict_view=True` for `view`,
`_unsafe_view` and `squeeze`) refuses a view whose result no placement can describe as an alias of the input
shards (an unevenly sharded dim flattened or split, a sharded size-1 dim squeezed). Under autograd `reshape`,
`flatten`, `ravel`, `reshape_as` and the composites built on them (tensordot, tensorsolve, instance_norm,
cartesian_prod, bilinear) reach DTensor as exactly such a `view`, so they are refused too. Inside
`view_copies()` these ops use torch's non-strict view strategy instead (the one torch gives `reshape` under
`inference_mode` and `view_copy`): the input is redistributed where a dim cannot stay sharded and the result
wraps that copy.

What you give up: the result does not share storage with the input. An in-place change of either afterwards
does not reach the other (on one device it would), so use this only where neither is modified in place while
the other is still read. The package does not do this by default because at `aten.view` a `reshape` (which may
copy) cannot be told from a `view` (which must alias). docs/torch-fixes-views.md has the details.

    from dtensor_ext.view_copies import view_copies
    with view_copies():
        y = torch.tensordot(a, b, dims=2)  # a, b unevenly sharded DTensors
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dtensor_ext import _compat
from dtensor_ext.torch_fixes.empty_views import empty_aware
from dtensor_ext.torch_fixes.uneven_views import copying_nested_uneven
from dtensor_ext.torch_fixes import restorer, undo_all

__all__ = ["view_copies"]

aten = torch.ops.aten

# strict op -> the torch function whose dim map torch's view strategy uses for it
_STRICT_VIEWS = {
    aten.view.default: torch.Tensor.view,
    aten._unsafe_view.default: torch.Tensor.view,
    aten.squeeze.default: torch.squeeze,
    aten.squeeze.dim: torch.squeeze,
    aten.squeeze.dims: torch.squeeze,
}


@contextlib.contextmanager
def view_copies() -> Iterator[None]:
    """Within the block, `view`/`reshape`/`squeeze` of DTensors redistribute where torch would refuse; not
    thread-safe (it changes DTensor's process-wide strategies), and not to be mixed with install()/uninstall()."""
    undos = []
    for op, torch_function in _STRICT_VIEWS.items():
        undos.append(restorer(op))
        schema_info = _compat.snapshot_registration(op).get("op_to_schema_info")
        _compat.register_view_strategy(op, torch_function, schema_info=schema_info)
        strategy = copying_nested_uneven(_compat.op_strategy_func(op))
        if torch_function is torch.Tensor.view:  # torch's view dim mapping hangs on some views of empty tensors
            strategy = empty_aware(strategy)
        _compat.register_op_strategy(op, strategy, schema_info=schema_info)
    _compat.clear_sharding_caches()
    try:
        yield
    finally:
        undo_all(undos)()
        _compat.clear_sharding_caches()
