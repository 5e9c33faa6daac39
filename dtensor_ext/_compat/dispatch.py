"""DTensor's dispatcher: handlers that bypass its generic path, and the redistribution functions it calls."""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable
from typing import Any

from torch._ops import OpOverload
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import OpSchema


# (source spec, target spec, graph-based or not) -> DTensor's redistribution steps, kept for the process as
# DTensor's own `_gen_transform_infos` keeps them
_TRANSFORM_PLANS: dict[tuple, list] = {}


@contextlib.contextmanager
def redistribution_plans_kept():
    """Inside the block DTensor's redistribution planner (``_gen_transform_infos_non_cached``, a function of the
    source and target specs alone) plans each pair once per process. DTensor keeps its plans itself except while it
    believes it is tracing, which a fake tensor mode makes it believe: there it planned every candidate strategy's
    input move again, for each op of each fake run, and with a strided shard involved each plan is a Dijkstra
    search (0.7 s per proof of Gemma2's attention on 2x2). Restored on exit."""
    from torch.distributed.tensor import _redistribute

    original = _redistribute.__dict__["_gen_transform_infos_non_cached"]

    def kept(src_spec, dst_spec, use_graph_based_transform=None):
        key = (src_spec, dst_spec, use_graph_based_transform)
        if key not in _TRANSFORM_PLANS:
            _TRANSFORM_PLANS[key] = original(src_spec, dst_spec, use_graph_based_transform)
        return _TRANSFORM_PLANS[key]

    _redistribute._gen_transform_infos_non_cached = kept
    try:
        yield
    finally:
        _redistribute._gen_transform_infos_non_cached = original


def custom_op_handler(op: OpOverload):
    """The function DTensor's dispatcher runs for `op` in place of its generic path (propagate, redistribute,
    run locally), or None; such a handler must apply any redistribution itself."""
    return DTensor._op_dispatcher._custom_op_handlers.get(op)


@contextlib.contextmanager
def quiet_torch_log(name: str, level: int):
    """Raise torch's logger `name` to `level` inside the block (messages the caller expects and handles)."""
    log = logging.getLogger(name)
    previous = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(previous)


def quiet_redistribute_warnings():
    """Silence torch's per-call "suboptimal redistribution" warnings while measuring many redistributions."""
    return quiet_torch_log("torch.distributed.tensor._redistribute", logging.ERROR)


def set_custom_op_handler(op: OpOverload, handler: Callable | None) -> Callable | None:
    """Put `handler` in DTensor's table of ops that bypass its generic path (None removes it); returns the old one."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    previous = handlers.get(op)
    if handler is None:
        handlers.pop(op, None)
    else:
        handlers[op] = handler
    return previous


def propagate_and_redistribute(op_call: OpOverload, args: tuple, kwargs: dict) -> tuple[Any, Any, OpSchema]:
    """What DTensor's generic dispatch does before running the local kernel, for handlers that run their own.

    Returns (op_info with the redistributed local args, as the kernel takes them: an op whose tensors sit in lists,
    e.g. `index_put`'s indices, gets its lists back; output sharding, the input schema the kernel runs on).
    """
    from torch.utils import _pytree as pytree

    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    schema = op_info.schema
    if sharding.needs_redistribute:
        dispatcher.redistribute_local_args(
            op_info, sharding.redistribute_schema, sharding.use_val_from_redistribute_schema
        )
        schema = sharding.redistribute_schema
    if op_info.args_tree_spec is not None:
        op_info.local_args = tuple(pytree.tree_unflatten(list(op_info.local_args), op_info.args_tree_spec))
    return op_info, sharding, schema


def suggested_input_specs(op_call: OpOverload, args: tuple, kwargs: dict) -> tuple:
    """The input specs DTensor's propagation picks for `op_call` on `args` (what it would redistribute them to),
    one per flat schema argument; nothing is moved."""
    op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    DTensor._op_dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    schema = sharding.redistribute_schema if sharding.needs_redistribute else op_info.schema
    return schema.args_schema


def redistribution_steps(source: Any, target: Any) -> list[tuple[int, Any, Any]]:
    """(mesh dim, from, to) for each step of torch's plan moving a tensor from spec `source` to spec `target`.
    While tracing for compile the specs may hold symbolic sizes, which the cached planner cannot hash: torch's own
    redistribution plans without its cache then, and so does this."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos, _gen_transform_infos_non_cached

    plan = _gen_transform_infos_non_cached if tracing_for_compile() else _gen_transform_infos
    return [(step.mesh_dim, *step.src_dst_placements) for step in plan(source, target)]


def redistribution_transforms(source: Any, target: Any) -> list[tuple[tuple[int, ...], Any, Any]]:
    """(mesh dims, from, to) for each collective or local step DTensor runs moving a tensor from spec `source` to
    spec `target`: torch's cached plan, with consecutive steps merged onto a flattened mesh where this torch merges
    them (a merged step names every mesh dim it spans)."""
    from torch.distributed.tensor import _redistribute

    steps = _redistribute._gen_transform_infos(source, target)
    optimize = getattr(_redistribute, "_optimize_transform_infos", None)
    if optimize is not None:
        steps = optimize(steps, source.mesh, source.placements, target.placements)
    return [
        (tuple(getattr(step, "original_mesh_dims", (step.mesh_dim,))), *step.src_dst_placements) for step in steps
    ]


def view_layout_spec(mesh, placements: tuple, tensor_meta) -> Any:
    """The spec of a value an op made, as DTensor holds it: a _StridedShard in it is a strided layout (what view ops
    produce, e.g. flattening two sharded dims), not a shard order encoded in placements. Redistributing it plans
    what DTensor runs for that value (a _StridedShard(0, split_factor=1) -> Shard(0) goes through Replicate; read
    as a shard order it would be no move at all)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return DTensorSpec(mesh, tuple(placements), tensor_meta=tensor_meta, use_strided_shard_as_shard_order=False)


def shard_to_shard_gathers(mesh) -> bool:
    """Whether DTensor moves Shard(i) -> Shard(j) by gathering the whole mesh dim and keeping a chunk (torch's
    `shard_dim_alltoall` does so on CPU meshes of real processes, where it takes gloo to lack all_to_all), rather
    than with one all_to_all."""
    from torch.distributed.tensor import _collective_utils

    return mesh.device_type == "cpu" and _collective_utils.local_tensor_mode() is None


def wrap_local_results(local_results: object, output_spec: Any) -> object:
    return DTensor._op_dispatcher.wrap(local_results, output_spec)


def respec_inplace(op_call: OpOverload, args: tuple, kwargs: dict, output_spec: Any) -> DTensor:
    """Give `args[0]` (the DTensor an in-place view op such as `squeeze_` changed) `output_spec` and the matching
    wrapper sizes and strides, as DTensor's dispatch does when the op's placements change."""
    from torch.utils._python_dispatch import return_and_correct_aliasing

    args[0]._spec = output_spec
    return return_and_correct_aliasing(op_call, args, kwargs, args[0])


def tp_convolution_kernels() -> tuple[Callable, Callable]:
    """torch's local convolution forward/backward runners (they exchange halos when a spatial dim is sharded)."""
    from torch.distributed.tensor._tp_conv import tp_convolution, tp_convolution_backward

    return tp_convolution, tp_convolution_backward


def load_linear_cross_entropy_ops() -> bool:
    """Define torch's chunked linear-cross-entropy custom ops (torch_nn::_linear_cross_entropy_batch_chunked*),
    which torch only registers when their module is first imported; False where this torch has no such module."""
    try:
        importlib.import_module("torch.nn.modules.linear_cross_entropy")
    except ModuleNotFoundError:
        return False
    return True


def mask_buffer_type() -> type:
    """DTensor's holder of the mask a `_MaskPartial` reduction (embedding, gather) zeroes before summing."""
    from torch.distributed.tensor._ops._mask_buffer import MaskBuffer

    return MaskBuffer


def dispatch_redistributor() -> Callable:
    """The function DTensor's dispatcher calls to move one local input to the layout a strategy asks for."""
    from torch.distributed.tensor import _dispatch

    return _dispatch.redistribute_local_tensor


def set_dispatch_redistributor(redistribute: Callable) -> None:
    from torch.distributed.tensor import _dispatch

    _dispatch.redistribute_local_tensor = redistribute


_REDISTRIBUTE_CALLERS = ("_redistribute", "_dispatch", "_api")  # modules calling redistribute_local_tensor by name


def redistribute_local_tensor_functions() -> dict[str, Callable]:
    """module name -> the `redistribute_local_tensor` it calls (explicit redistribute, dispatch, full_tensor's
    backward and Redistribute's own backward all go through one of these names)."""
    modules = {name: importlib.import_module(f"torch.distributed.tensor.{name}") for name in _REDISTRIBUTE_CALLERS}
    return {name: m.redistribute_local_tensor for name, m in modules.items() if hasattr(m, "redistribute_local_tensor")}


def set_redistribute_local_tensor(module_name: str, function: Callable) -> None:
    importlib.import_module(f"torch.distributed.tensor.{module_name}").redistribute_local_tensor = function


def tracing_for_compile() -> bool:
    """Whether dynamo/make_fx is tracing (DTensor plans differently then, without its caches)."""
    from torch.distributed.tensor._redistribute import _are_we_tracing

    return _are_we_tracing()


def own_rows(rows: int, mesh, mesh_dim: int) -> tuple[Any, Any]:
    """(how many, first) of `rows` this rank holds when they are sharded on `mesh_dim`; on simulated ranks each is a
    per-rank integer that ops on the rank's local tensors read as that rank's value."""
    from torch.distributed.tensor import Shard

    return Shard.local_shard_size_and_offset(rows, mesh.size(mesh_dim), mesh._sym_get_coordinate(mesh_dim))
