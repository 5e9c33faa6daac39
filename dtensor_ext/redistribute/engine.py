"""The planner as DTensor's own redistribution engine (`dtensor_ext.install(planner=True)`).

DTensor moves local tensors through one function, `redistribute_local_tensor`, which its explicit redistribute,
the redistribution dispatch does before an op, `full_tensor()` and the backward of all of them call by name. We
put the planner's executor in its place, so DTensor's autograd (gradient placements, Partial gradients kept
Partial) stays exactly as it is and only the collectives change. Requests the planner does not take (a change of
mesh, `Shard -> Partial`, tracing for torch.compile, a rank outside the mesh) go to the function we replaced.
"""

from __future__ import annotations

import contextlib
import functools

from dtensor_ext import _compat
from dtensor_ext._compat import Partial, Replicate
from dtensor_ext.redistribute.executor import execute_local, plan_for
from dtensor_ext.redistribute.placements import PARTIAL_OPS, is_shard

__all__ = ["enable", "disable", "is_enabled", "torch_redistribution"]

_replaced: dict[str, object] = {}  # module name -> the function it called before enable()
_options: dict = {}


def enable(**plan_options) -> None:
    """Route DTensor's redistribution through the planner (`plan_options` as for `plan`, plus `calibration`: an
    autotune calibration file, default $DTENSOR_EXT_CALIBRATION). The objective defaults to bytes (ties broken by
    modelled time): the time model's latency terms can trade bytes for fewer messages on small tensors, which is
    not what a user turning the planner on asks for."""
    disable()
    _options.clear()
    _options.update({"objective": "bytes", **plan_options})
    for module_name, previous in _compat.redistribute_local_tensor_functions().items():
        _replaced[module_name] = previous
        _compat.set_redistribute_local_tensor(module_name, _planned(previous))


def disable() -> None:
    """Put back the functions enable() replaced."""
    for module_name, previous in _replaced.items():
        _compat.set_redistribute_local_tensor(module_name, previous)
    _replaced.clear()


def is_enabled() -> bool:
    return bool(_replaced)


@contextlib.contextmanager
def torch_redistribution():
    """DTensor's own redistribution for the duration (to compare with torch), then the engine as it was."""
    was_on, options = is_enabled(), dict(_options)
    disable()
    try:
        yield
    finally:
        if was_on:
            enable(**options)


def _planned(previous):
    # wraps: probes that read the replaced function (its source, its name) still see torch's
    @functools.wraps(previous)
    def redistribute_local_tensor(local_tensor, current_spec, target_spec, **kwargs):
        if not _takes(current_spec, target_spec):
            return previous(local_tensor, current_spec, target_spec, **kwargs)
        meta = current_spec.tensor_meta
        chosen, choices = plan_for(
            meta.shape, current_spec.mesh, current_spec.placements, target_spec.placements, local_tensor.dtype,
            **_options,
        )
        return execute_local(local_tensor, current_spec.mesh, chosen, choices)

    redistribute_local_tensor.replaced = previous
    return redistribute_local_tensor


def _takes(current_spec, target_spec) -> bool:
    """Whether the planner runs this move (see the module docstring for what it leaves to torch)."""
    if current_spec.mesh != target_spec.mesh or current_spec.tensor_meta is None:
        return False
    if _compat.tracing_for_compile() or not _compat.rank_in_mesh(current_spec.mesh):
        return False
    for p, q in zip(current_spec.placements, target_spec.placements):
        for placement in (p, q):
            # Partial subclasses (masked, norm partials) reduce and partition in their own ways
            if isinstance(placement, Partial) and (type(placement) is not Partial or placement.reduce_op not in PARTIAL_OPS):
                return False
            if not (is_shard(placement) or isinstance(placement, (Partial, Replicate))):
                return False
        if isinstance(q, Partial) and q != p and not isinstance(p, Replicate):
            return False
    return True
