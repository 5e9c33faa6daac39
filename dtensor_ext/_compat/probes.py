"""Feature checks: what the running torch does on a tiny input, on a probe mesh with no process group behind it.

The torch fixes decide from these whether a defect is there, never from version numbers or source text. They cost
time and memory (the first propagation imports torch._dynamo), so `import dtensor_ext` runs them at DTensor's first
use (`at_first_dtensor_use`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Sequence

import torch
from torch._ops import OpOverload
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, RuntimeSchemaInfo
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dtensor_ext._compat.propagation import clear_sharding_caches, propagate_cold, propagator
from dtensor_ext._compat.testing import outside_simulated_ranks, probing_context
from dtensor_ext._compat.types import tensor_meta


def conv_handler_applies_redistribution(op: OpOverload, handler: Callable) -> bool:
    """Whether a convolution dispatch handler moves its inputs as its propagation chose before computing (feature
    check: `handler` runs a conv1d of a replicated [1, 1, 3] input with a Partial(sum) [1, 1, 1] weight, which
    torch's conv rule must move, on a 2-rank probe mesh; the probe stops at whichever comes first, DTensor's
    redistribution of the local args or torch's local conv kernel)."""
    from torch.distributed.tensor import _tp_conv

    class Redistributed(Exception):
        pass

    class Computed(Exception):
        pass

    def stop(outcome: type[Exception]) -> Callable:
        def raise_outcome(*args, **kwargs):
            raise outcome

        return raise_outcome

    mesh = probe_mesh((2,))
    with outside_simulated_ranks():
        x, weight, grad = (DTensor.from_local(torch.ones(shape), mesh, [p], run_check=False)
                           for shape, p in (((1, 1, 3), Replicate()), ((1, 1, 1), Partial()), ((1, 1, 3), Replicate())))
    conv_args = (None, [1], [0], [1], False, [0], 1)
    args = (x, weight, *conv_args) if op is torch.ops.aten.convolution.default else (grad, x, weight, *conv_args,
                                                                                      [True, True, False])
    dispatcher = DTensor._op_dispatcher
    kernels = {name: getattr(_tp_conv, name) for name in ("tp_convolution", "tp_convolution_backward")}
    dispatcher.redistribute_local_args = stop(Redistributed)
    for name in kernels:
        setattr(_tp_conv, name, stop(Computed))
    try:
        with outside_simulated_ranks():
            handler(op, args, {})
    except Redistributed:
        return True
    except Computed:
        return False
    finally:
        del dispatcher.redistribute_local_args
        for name, kernel in kernels.items():
            setattr(_tp_conv, name, kernel)
    return True  # it computed some other way, never on the unmoved pieces


def view_groups_drops_empty_dims() -> bool:
    """Whether torch's view dim mapping loses a size-0 dim in an identity view (feature check; the hanging
    cases are not probed)."""
    from torch.distributed.tensor._ops import _view_ops

    return _view_ops.view_groups((0, 4), (0, 4)) != (_view_ops.InputDim(0), _view_ops.InputDim(1))


def shard_to_partial_refused() -> bool:
    """Whether torch's local redistribution refuses some Shard -> Partial move (feature check: Shard(0) of a [2, 2]
    tensor on a 2-rank probe mesh to Partial(max), and to Partial(sum))."""
    return not (_moves_shard_to_partial(Partial("max")) and shard_to_partial_sum_supported())


@functools.cache
def shard_to_partial_sum_supported() -> bool:
    """Whether torch turns a Shard into Partial(sum) locally itself (2.14+: zeros outside each rank's shard)."""
    return _moves_shard_to_partial(Partial("sum"))


def _moves_shard_to_partial(target: Partial) -> bool:
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    # outside any mode: the first call may come from inside a fake run (a policy proof), where the probe's tensors
    # would be fake and the move's verdict cached wrong (2.15 then gathered for every Shard -> Partial(sum))
    with probing_context():
        x = torch.zeros(2, 2)
        try:  # rank 0 holds row 0; the move is local, so the probe mesh needs no process group
            redistribute_local_tensor(x[:1], probe_spec(x, (Shard(0),)), probe_spec(x, (target,)))
        except RuntimeError:
            return False
    return True


def inplace_placement_refusal() -> bool:
    """Whether torch refuses an in-place copy into a tensor with an empty shard from a source in another layout
    (its N-D expansion drops the candidate that moves the source to the layout with the empty shard). Feature
    check: `self.copy_(src)`, [1, 2] tensors, `self` Shard(0) on a 2-rank probe mesh, `src` replicated."""
    self_, src = torch.zeros(1, 2), torch.zeros(1, 2)
    args = (probe_spec(self_, (Shard(0),)), probe_spec(src, (Replicate(),)))
    return not propagates(torch.ops.aten.copy_.default, args)


def probe_mesh(shape: Sequence[int]):
    """A mesh of `shape` as rank 0 sees it, with no process group behind it: enough for sharding propagation on a
    tiny input (nothing is communicated), so feature checks run before or without any process group."""
    from torch.distributed.device_mesh import DeviceMesh

    with outside_simulated_ranks():
        mesh = torch.arange(math.prod(shape), device="cpu").reshape(tuple(shape))
        return DeviceMesh("cpu", mesh, _init_backend=False, _rank=0)


def probe_spec(t: torch.Tensor, placements: Sequence[Placement], mesh_shape: Sequence[int] = (2,)) -> DTensorSpec:
    """`t`'s spec placed so on a probe mesh of `mesh_shape`."""
    return DTensorSpec(probe_mesh(mesh_shape), tuple(placements), tensor_meta=tensor_meta(t))


def propagates(op: OpOverload, args: tuple, kwargs: dict | None = None) -> bool:
    """Whether torch's sharding propagation (both caches bypassed) finds a strategy for `op` on `args`, whose tensor
    arguments are DTensorSpecs."""
    return output_placements(op, args, kwargs) is not None


def output_placements(op: OpOverload, args: tuple, kwargs: dict | None = None, *,
                      schema_info: RuntimeSchemaInfo | None = None) -> tuple | None:
    """The placements torch's sharding propagation (both caches bypassed) gives `op`'s first output for `args`
    (tensor arguments as DTensorSpecs; `schema_info` as the dispatch would pass it, needed where `args` nest specs
    in a list); None where it refuses (a RuntimeError, an assertion, or 2.13's ValueError for output specs that do
    not match the op's outputs)."""
    try:
        with outside_simulated_ranks():
            schema = OpSchema(op, tuple(args), dict(kwargs or {}), schema_info=schema_info)
            output = propagate_cold(schema).output_spec
    except (RuntimeError, AssertionError, KeyError, ValueError):
        return None
    return (output[0] if isinstance(output, (tuple, list)) else output).placements


@contextlib.contextmanager
def probing_dtensor_ops():
    """Context for running real DTensor ops (ones that need no communication) on probe DTensors as rank 0: outside
    simulated ranks, and both sharding caches cleared on leaving, so a probe leaves nothing behind."""
    try:
        with outside_simulated_ranks():
            yield
    finally:
        clear_sharding_caches()


def probe_dtensor(local: torch.Tensor, placements: Sequence[Placement], shape: Sequence[int],
                  mesh_shape: Sequence[int] = (2,)) -> DTensor:
    """A DTensor of global `shape` placed so on a probe mesh of `mesh_shape`, whose rank 0 holds `local`."""
    shape = torch.Size(shape)
    return DTensor.from_local(local, probe_mesh(mesh_shape), tuple(placements), run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())



class _Hook:
    """Calls `fire()`, then `call`; every other attribute is `call`'s (the propagator's cache has cache_clear)."""

    def __init__(self, call: Callable, fire: Callable[[], None]):
        self._call, self._fire = call, fire

    def __call__(self, *args, **kwargs):
        self._fire()
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._call, name)


def at_first_dtensor_use(callback: Callable[[], None]) -> Callable[[bool], None]:
    """Run `callback` once, before this process first makes a DTensor or asks DTensor's sharding propagation for a
    strategy (whichever comes first), outside any dispatch mode (fake, LocalTensor, compile tracing) and outside
    dynamo. Returns `settle(run)`: takes the hooks away at once, running callback first if `run` (and it has not
    run yet).

    The hooks are `DTensor.__new__` and the propagator's two entries (cached, uncached); they are put back, the very
    objects that were there, once callback has run, so later calls pay nothing. A thread that comes while callback
    runs waits for it; callback's own DTensors and propagations (feature checks) pass straight through."""
    prop = propagator()
    new, cached = DTensor.__dict__["__new__"], prop.__dict__["propagate_op_sharding"]
    lock, armed = threading.RLock(), [True]

    def put_back() -> None:
        DTensor.__new__ = new
        prop.propagate_op_sharding = cached
        prop.__dict__.pop("propagate_op_sharding_non_cached", None)

    @torch._disable_dynamo
    def fire() -> None:
        with lock:
            if not armed[0]:
                return
            armed[0] = False
            try:
                with probing_context():
                    callback()
            finally:
                put_back()

    def settle(run: bool) -> None:
        if run:
            fire()
        with lock:
            if armed[0]:
                armed[0] = False
                put_back()

    DTensor.__new__ = staticmethod(_Hook(new, fire))
    prop.propagate_op_sharding = _Hook(cached, fire)
    prop.propagate_op_sharding_non_cached = _Hook(prop.propagate_op_sharding_non_cached, fire)
    return settle
