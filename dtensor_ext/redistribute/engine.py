"""The planner as DTensor's own redistribution engine (`dtensor_ext.install(planner=True)`).

DTensor moves local tensors through one function, `redistribute_local_tensor`, which its explicit redistribute,
the redistribution dispatch does before an op, `full_tensor()` and the backward of all of them call by name. We
put a chooser in its place, so DTensor's autograd (gradient placements, Partial gradients kept Partial) stays
exactly as it is and only the collectives change. For each request (source and target spec) it decides once, and
remembers: the planner's plan runs only where it is strictly better than what torch runs for the same move (fewer
bytes received on the busiest rank, or as many bytes in less modelled time), priced from torch's own plan (see
dtensor_plan); otherwise, and for the requests the planner does not take (a change of mesh, `Shard -> Partial`,
tracing for torch.compile, a rank outside the mesh), torch's function runs, with torch's collectives.
"""
from __future__ import annotations

import contextlib
import functools

from dtensor_ext import _compat
from dtensor_ext._compat import Partial, Replicate
from dtensor_ext._compat import enabled_local_tensor_mode
from dtensor_ext.redistribute.choices import calibration_for
from dtensor_ext.redistribute.cost import IdealCostModel
from dtensor_ext.redistribute.dtensor_plan import dtensor_steps
from dtensor_ext.redistribute.executor import Program, plan_for
from dtensor_ext.redistribute.placements import PARTIAL_OPS, is_shard
from dtensor_ext.redistribute.plan import Plan
from dtensor_ext.redistribute.steps import StepBuilder

__all__ = ["enable", "disable", "is_enabled", "torch_redistribution"]

_wrappers: dict[str, object] = {}  # module name -> the engine's function installed there (`.replaced`: what it wraps)
_on = False  # whether the wrappers plan (off: they pass every call to the function they wrap)
_options: dict = {}
# (source spec, target spec, simulated ranks) -> (mesh, the Program that runs the move or None where torch runs it)
_decisions: dict = {}


def enable(**plan_options) -> None:
    """Route DTensor's redistribution through the planner (`plan_options` as for `plan`, plus `calibration`: an
    autotune calibration file, default $DTENSOR_EXT_CALIBRATION). The objective defaults to bytes (ties broken by
    modelled time): the time model's latency terms can trade bytes for fewer messages on small tensors, which is
    not what a user turning the planner on asks for. A wrapper still in place (under a torch fix's) is switched back
    on, not wrapped again."""
    _options.clear()
    _decisions.clear()
    _options.update({"objective": "bytes", **plan_options})
    global _on
    _on = True
    for module_name, current in _compat.redistribute_local_tensor_functions().items():
        if module_name not in _wrappers:
            _wrappers[module_name] = _planned(current)
            _compat.set_redistribute_local_tensor(module_name, _wrappers[module_name])


def disable() -> None:
    """Torch's redistribution again. A wrapper DTensor calls directly is replaced by the function it wrapped; one
    that a torch fix applied later has wrapped in turn (DTENSOR_EXT_PLANNER=1 enables the engine at import, before
    the fixes) stays, passing every call through, until the fix is undone and a later disable() can take it off:
    putting torch's function back there would drop the fix."""
    global _on
    _on = False
    functions = _compat.redistribute_local_tensor_functions()
    for module_name, wrapper in list(_wrappers.items()):
        if functions.get(module_name) is wrapper:
            _compat.set_redistribute_local_tensor(module_name, wrapper.replaced)
            del _wrappers[module_name]


def is_enabled() -> bool:
    return _on


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
        if not _on:
            return previous(local_tensor, current_spec, target_spec, **kwargs)
        key = (current_spec, target_spec, enabled_local_tensor_mode() is not None)
        try:
            decided = _decisions.get(key)
        except TypeError:  # a symbolic size (dynamic shapes under torch.compile) makes the spec unhashable
            return previous(local_tensor, current_spec, target_spec, **kwargs)
        # meshes compare equal by shape and ranks; a decision holds the groups of the mesh it was made on
        if decided is None or decided[0] is not current_spec.mesh:
            if _compat.tracing_for_compile():  # no decision from traced (possibly symbolic) specs
                return previous(local_tensor, current_spec, target_spec, **kwargs)
            decided = _decisions[key] = (current_spec.mesh, _decide(current_spec, target_spec))
        program = decided[1]
        # while tracing for torch.compile torch plans differently, without its caches: its move (asked only where
        # the planner would run, as the question costs more than the lookup)
        if program is None or _compat.tracing_for_compile():
            return previous(local_tensor, current_spec, target_spec, **kwargs)
        return program.run(local_tensor)

    redistribute_local_tensor.replaced = previous
    return redistribute_local_tensor


def _decide(current_spec, target_spec) -> Program | None:
    """The planner's Program for this move where its plan beats torch's, else None (torch runs it)."""
    if not _takes(current_spec, target_spec):
        return None
    meta, mesh = current_spec.tensor_meta, current_spec.mesh
    ours = plan_for(meta.shape, mesh, current_spec.placements, target_spec.placements, meta.dtype, **_options)
    theirs = torch_plan(current_spec, target_spec, ours)
    if theirs is not None and _score(ours) >= _score(theirs) and _ascending(mesh):
        return None
    return Program(mesh, ours)


def _ascending(mesh) -> bool:
    """Whether global ranks ascend along every mesh dim. c10d orders a group's ranks by global rank, torch's
    collectives concatenate in that order and so misplace shards on other meshes, where the planner (which reads
    each group's order) moves every tensor, ties included."""
    ranks = mesh.mesh
    return all(bool((ranks.diff(dim=d) > 0).all()) for d in range(ranks.dim()) if ranks.size(d) > 1)


def torch_plan(current_spec, target_spec, ours: Plan) -> Plan | None:
    """What torch runs for this move, priced with the cost model that priced `ours`; None where torch's planner
    refuses the move."""
    mesh = current_spec.mesh
    try:
        transforms = _compat.redistribution_transforms(current_spec, target_spec)
    except (RuntimeError, ValueError, AssertionError, NotImplementedError):
        return None
    model = _options.get("cost_model")
    if model is None:
        model = calibration_for(_options.get("calibration"), mesh, ours.dtype)[0] or IdealCostModel()
    builder = StepBuilder(ours.shape, ours.mesh_shape, ours.dtype, model.bind(ours.mesh_shape))
    steps = dtensor_steps(builder, ours.src, transforms, _compat.shard_to_shard_gathers(mesh))
    return Plan("dtensor", ours.shape, ours.mesh_shape, ours.dtype, ours.src, ours.dst, tuple(steps), ours.source_bytes)


def _score(plan: Plan) -> tuple[int, float]:
    """Bytes first (received on the busiest rank), then modelled time."""
    return plan.max_recv_bytes, plan.time_s


def _takes(current_spec, target_spec) -> bool:
    """Whether the planner runs this move (see the module docstring for what it leaves to torch)."""
    if current_spec.mesh != target_spec.mesh or current_spec.tensor_meta is None:
        return False
    if not _compat.rank_in_mesh(current_spec.mesh):
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
