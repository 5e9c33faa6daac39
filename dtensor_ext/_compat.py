"""The one door to torch internals.

Every private torch import and every version/feature check lives here, so that a torch release that moves
something breaks exactly one module. Features are detected by keyword or attribute, never by version string
alone: CI runs 2.13, the GPU machine 2.11, and 2.12-2.15 must keep working.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol  # noqa: F401  (re-exported)
from torch._ops import OpOverload, OpOverloadPacket
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _sharding_prop as _sharding_prop_module
from torch.distributed.tensor._collective_utils import (  # noqa: F401  (re-exported)
    MeshTopoInfo,
    allgather_cost,
    allreduce_cost,
    redistribute_cost,
    reduce_scatter_cost,
)
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo, TupleStrategy
from torch.distributed.tensor._ops import single_dim_strategy as _sds
from torch.distributed.tensor._ops.utils import (  # noqa: F401  (re-exported)
    is_tensor_evenly_shardable, is_tensor_shardable,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

try:  # LocalTensorMode appeared with the simulated-rank machinery (2.9+).
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
except ImportError as exc:  # pragma: no cover - only on torch too old for this package
    raise ImportError("dtensor_ext needs torch.distributed._local_tensor (torch >= 2.11)") from exc

__all__ = [
    "DTensorSpec",
    "LocalTensor",
    "LocalTensorMode",
    "OpSchema",
    "Partial",
    "Placement",
    "Replicate",
    "RuntimeSchemaInfo",
    "Shard",
    "ShardingPlaceholder",
    "StridedShard",
    "TensorMeta",
    "TORCH_VERSION",
    "auto_register_variants",
    "clear_sharding_caches",
    "compute_local_shape_and_global_offset",
    "propagator",
    "register_single_dim",
    "restore_registration",
    "snapshot_registration",
    "torch_strategy_kind",
]

TORCH_VERSION = torch.__version__.split("+")[0]
ShardingPlaceholder = _sds._ShardingPlaceholder
StridedShard = _StridedShard

_REGISTER_PARAMS = frozenset(inspect.signature(_sds.register_single_dim_strategy).parameters)
# 2.11 asserts that a rule never lists the all-Replicate row and never uses None; 2.12+ accept both.
REPLICATE_ROW_ALLOWED = "allow_uneven_sharding" in _REGISTER_PARAMS


def propagator():
    return DTensor._op_dispatcher.sharding_propagator


def clear_sharding_caches() -> None:
    """Both caches must go: the Python LRU and the C++ fast path keep stale strategies otherwise."""
    propagator().propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


# Kinds of strategy torch registers for an op directly; "decomposition" is its generic fallback of last resort
# (it traces the op's decomposition and propagates through the pieces), which a direct rule takes precedence over.
DIRECT_STRATEGY_KINDS = ("single_dim", "op_strategy", "rule")


def torch_strategy_kind(op: OpOverload) -> str | None:
    """How the running torch shards `op` itself: 'single_dim', 'op_strategy', 'rule', 'decomposition' or None."""
    prop = propagator()
    if op in prop.op_single_dim_strategy_funcs:
        return "single_dim"
    if op in prop.op_strategy_funcs:
        return "op_strategy"
    if op in prop.op_to_rules:
        return "rule"
    if _has_sharding_decomposition(op):
        return "decomposition"
    return None


def _has_sharding_decomposition(op: OpOverload) -> bool:
    try:
        from torch.distributed.tensor._decompositions import DecompShardingStrategy
    except ImportError:  # torch without the decomposition fallback
        return False
    return bool(DecompShardingStrategy.has_decomp(op))


_REGISTRATION_TABLES = (
    "op_single_dim_strategy_funcs",
    "op_to_schema_info_for_single_dim_strategy",
    "op_strategy_funcs",
    "op_to_rules",
    "op_to_schema_info",
    "op_to_scalar_shape_adjuster",  # 2.13+; absent tables are skipped
)


def snapshot_registration(op: OpOverload) -> dict[str, Any]:
    """Everything the propagator knows about `op`, so that it can be put back exactly."""
    prop = propagator()
    return {t: getattr(prop, t)[op] for t in _REGISTRATION_TABLES if op in getattr(prop, t, {})}


def restore_registration(op: OpOverload, snapshot: dict[str, Any]) -> None:
    prop = propagator()
    for table in _REGISTRATION_TABLES:
        entries = getattr(prop, table, None)
        if entries is None:
            continue
        if table in snapshot:
            entries[op] = snapshot[table]
        else:
            entries.pop(op, None)


def single_dim_func(op: OpOverload) -> Callable | None:
    """The raw rule function registered for `op` (unwrapping torch's info record where there is one); also the rule
    a torch fix moved behind an op_strategy filter (it keeps the record as `single_dim_info`)."""
    info = propagator().op_single_dim_strategy_funcs.get(op)
    if info is None:
        info = getattr(propagator().op_strategy_funcs.get(op), "single_dim_info", None)
    if info is None:
        return None
    return getattr(info, "func", info)


def _adapt_rows_for_torch(func: Callable) -> Callable:
    """On 2.11 drop the all-Replicate row (torch adds it and asserts we did not) and refuse None entries."""
    if REPLICATE_ROW_ALLOWED:
        return func

    def adapted(op, args_meta, kwargs_meta):
        rows = []
        for row in func(op, args_meta, kwargs_meta):
            if any(p is None for p in row):
                raise NotImplementedError(f"{op}: rows with None entries need torch >= 2.12")
            if not all(isinstance(p, Replicate) for p in row):
                rows.append(row)
        return rows

    adapted.__wrapped__ = func
    return adapted


def register_single_dim(
    op: OpOverload,
    func: Callable,
    *,
    schema_info: RuntimeSchemaInfo | None = None,
    allow_uneven_sharding: bool = False,
    allow_unbacked_sharding: bool | None = None,
) -> None:
    """Register through torch's own decorator, passing only the keywords the running torch accepts."""
    wanted = {
        "schema_info": schema_info,
        "allow_uneven_sharding": allow_uneven_sharding,
        "allow_unbacked_sharding": allow_unbacked_sharding,
    }
    kwargs = {k: v for k, v in wanted.items() if k in _REGISTER_PARAMS}
    _sds.register_single_dim_strategy(op, **kwargs)(_adapt_rows_for_torch(func))


def register_scalar_adjuster(op: OpOverload, local_scalars: Callable) -> None:
    """Have DTensor rewrite `op`'s shape-derived scalar args for each rank's local tensors before running it.

    local_scalars(args, local_shapes) -> args, where local_shapes lists the local shape of every tensor arg.
    """
    prop = propagator()
    if not hasattr(prop, "op_to_scalar_shape_adjuster"):
        raise NotImplementedError(f"{op}: this torch cannot rewrite scalar args per rank (needs torch >= 2.13)")

    def adjust(input_specs: Sequence[DTensorSpec], schema: OpSchema) -> OpSchema:
        local_shapes = [
            compute_local_shape_and_global_offset(spec.tensor_meta.shape, spec.mesh, spec.placements)[0]
            for spec in input_specs
        ]
        return OpSchema(schema.op, tuple(local_scalars(schema.args_schema, local_shapes)), schema.kwargs_schema)

    prop.op_to_scalar_shape_adjuster[op] = adjust


def auto_register_variants() -> bool:
    """Derive in-place/out/functional variants of single-dim rules, where this torch can (2.12+)."""
    try:
        from torch.distributed.tensor._ops.autogen import auto_register_op_variants
    except ImportError:
        return False
    auto_register_op_variants()
    return True


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=t.shape, stride=t.stride(), dtype=t.dtype)


def is_placeholder(p: object) -> bool:
    return isinstance(p, ShardingPlaceholder)


def fill_placeholders(row: Sequence[Any], shard_type: Callable[[int], Placement] = Shard) -> list[Any]:
    return [shard_type(p.dim) if is_placeholder(p) else p for p in row]


def torch_op_names(fn: object) -> tuple[str, ...] | None:
    """('ns::op.overload', 'ns::op') for a torch.ops overload, ('ns::op',) for a packet, None for anything else."""
    if isinstance(fn, OpOverload):
        return (f"{fn._schema.name}.{fn._overloadname}", fn._schema.name)
    if isinstance(fn, OpOverloadPacket):
        return (fn._qualified_op_name,)
    return None


def current_local_tensor_mode() -> LocalTensorMode | None:
    """The simulated-rank mode in effect, if any."""
    from torch.distributed._local_tensor import local_tensor_mode

    return local_tensor_mode()


def process_group_of(group_name: Any):
    """The process group a functional collective names (its ``group_name`` argument)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def group_size(group_name: Any) -> int:
    return process_group_of(group_name).size()


def fake_mode_of(values: Sequence[Any]):
    """The FakeTensorMode the traced ``values`` live in (a fresh one where they carry none), for graph passes."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)]) or FakeTensorMode()


def default_store():
    """The c10d key-value store of the default process group (private in torch); holds the tuner's failure flag."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def flat_collectives():
    """(all_gather, reduce_scatter) on flat tensors: the *_single names where this torch has them (2.13+ deprecates
    the *_into_tensor/*_tensor names), the older names otherwise."""
    import torch.distributed as dist

    return (
        getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
        getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,
    )


def op_strategy_rows(op: OpOverload, mesh, args: Sequence[Any], kwargs: dict[str, Any], placements) -> set[tuple]:
    """What torch's own strategy for `op` offers when its tensor inputs are placed as given.

    Works whether torch shards `op` with an op_strategy function or (2.14+ for cat, cumsum, scatter_add,
    logsumexp...) a single-dim rule, which is expanded over the mesh by torch's own full expansion.
    args/kwargs hold real tensors (or lists of them); placements gives one placement tuple per tensor, in
    pytree-flattened order. Returns rows (output placements..., input placements...), one placement tuple each,
    so that a rule of ours can be shown to cover everything torch's rule would pick.
    """
    placement_iter = iter(placements)

    def as_spec(x):
        if isinstance(x, torch.Tensor):
            return DTensorSpec(mesh, tuple(next(placement_iter)), tensor_meta=tensor_meta(x))
        if isinstance(x, (list, tuple)) and x and all(isinstance(e, torch.Tensor) for e in x):
            return [as_spec(e) for e in x]
        return x

    prop = propagator()
    info = prop.op_single_dim_strategy_funcs.get(op)
    schema_info = prop.op_to_schema_info_for_single_dim_strategy.get(op) if info is not None else None
    spec_schema = OpSchema(
        op, tuple(as_spec(a) for a in args), {k: as_spec(v) for k, v in kwargs.items()}, schema_info=schema_info
    )
    if info is not None:
        strategy_schema = prop._wrap_with_op_strategy(spec_schema)
        out_meta = prop._propagate_tensor_meta_non_cached(spec_schema)
        result = full_single_dim_expansion(mesh, strategy_schema, info, out_meta)(
            op, strategy_schema.args_meta, strategy_schema.kwargs_meta
        )
    else:

        def as_strategy(x):
            if isinstance(x, DTensorSpec):
                return OpStrategy([OpSpec(x)])
            if isinstance(x, list) and x and all(isinstance(e, DTensorSpec) for e in x):
                return TupleStrategy([as_strategy(e) for e in x])
            return x

        result = prop.op_strategy_funcs[op](
            OpSchema(op, tuple(as_strategy(a) for a in spec_schema.args_schema),
                     {k: as_strategy(v) for k, v in spec_schema.kwargs_schema.items()})
        )
    rows = set()
    for spec in result.strategies:
        outputs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        inputs = pytree.tree_leaves(spec.input_specs)
        rows.add(tuple(s.placements if s is not None else None for s in (*outputs, *inputs)))
    return rows


def compare_operator(*args, **kwargs):
    """torch's own strategy validator (2.12+): checks the rules DTensor holds for an OpInfo op on a fake group.

    A single-dim rule that a layout filter took over (an op_strategy function carrying `single_dim_info`: even
    shards only, no empty shards a kernel rejects) is validated as the rule itself: the validator checks rules
    row by row, and its op_strategy path cannot pass the filter a list of tensors (indices, tensor lists).
    """
    from torch.distributed.tensor._ops.strategy_validation import compare_operator as validate

    with _filtered_rules_as_rules():
        return validate(*args, **kwargs)


@contextlib.contextmanager
def _filtered_rules_as_rules():
    prop = propagator()
    filtered = {op: f for op, f in prop.op_strategy_funcs.items() if getattr(f, "single_dim_info", None) is not None}
    snapshots = {op: snapshot_registration(op) for op in filtered}
    for op, strategy in filtered.items():
        schema_info = prop.op_to_schema_info.get(op)
        restore_registration(op, {})
        prop.op_single_dim_strategy_funcs[op] = strategy.single_dim_info
        if schema_info is not None:
            prop.op_to_schema_info_for_single_dim_strategy[op] = schema_info
    clear_sharding_caches()
    try:
        yield
    finally:
        for op, snapshot in snapshots.items():
            restore_registration(op, snapshot)
        clear_sharding_caches()


# --- Expansion of single-dim rules to the N-D mesh (fast propagation swaps it) ---

PreparedSingleDimStrategy = _sds._PreparedSingleDimStrategy
# torch's own N-D expansion, captured at import so that it can always be called and put back
full_single_dim_expansion = _sds._expand_single_dim_strategy_to_mesh


def single_dim_expansion() -> Callable:
    """The expansion function the propagator calls now."""
    return _sharding_prop_module._expand_single_dim_strategy_to_mesh


def set_single_dim_expansion(expand: Callable) -> None:
    """Make the propagator expand single-dim rules with `expand` (same signature as torch's); clears both caches."""
    _sharding_prop_module._expand_single_dim_strategy_to_mesh = expand
    clear_sharding_caches()


def propagate_cold(schema: OpSchema):
    """Sharding propagation for `schema` bypassing both caches (what a never-seen op signature pays)."""
    return propagator().propagate_op_sharding_non_cached(schema)


def greedy_redistribution_planned(source: DTensorSpec) -> bool:
    """True where torch prices a move away from `source` (to placements in default order, no strided shards) with
    its greedy planner: mesh dims right to left, then left to right. Fast propagation's tighter bound relies on it."""
    from torch.distributed.tensor import _redistribute

    return not getattr(_redistribute, "_FORCE_MIN_COST_REDISTRIBUTION_PLAN", True) and (
        DTensorSpec.is_default_device_order(source.shard_order)
    )


def rank_in_mesh(mesh) -> bool:
    """Whether this process is one of `mesh`'s ranks (torch prices every redistribution 0 elsewhere)."""
    return mesh._is_current_rank_part_of_mesh()


def dtensor_collective_costs():
    """torch's own cost formulas for collectives (microseconds) and its topology record, for comparison."""
    return MeshTopoInfo, {"all_gather": allgather_cost, "all_reduce": allreduce_cost,
                          "reduce_scatter": reduce_scatter_cost}


def enabled_local_tensor_mode():
    """The active LocalTensorMode (simulated ranks) or None in a real multi-process run."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode as enabled

    return enabled()


def local_int(values: dict[int, int]):
    """One int per simulated rank, as a SymInt collectives and views accept."""
    from torch.distributed._local_tensor import LocalIntNode

    return torch.SymInt(LocalIntNode(values))


def custom_op_handler(op: OpOverload):
    """The function DTensor's dispatcher runs for `op` in place of its generic path (propagate, redistribute,
    run locally), or None; such a handler must apply any redistribution itself."""
    return DTensor._op_dispatcher._custom_op_handlers.get(op)


def local_tensor_values(t: torch.Tensor) -> dict[int, torch.Tensor] | None:
    """rank -> plain tensor for a LocalTensor (one value per simulated rank); None for any other tensor."""
    return dict(t._local_tensors) if isinstance(t, LocalTensor) else None


@contextlib.contextmanager
def quiet_redistribute_warnings():
    """Silence torch's per-call "suboptimal redistribution" warnings while measuring many redistributions."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def inductor_custom_pass_api():
    """(CustomGraphPass, get_hash_for_files): inductor's base class for post-grad passes and its source hasher."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    return CustomGraphPass, get_hash_for_files


def opinfo_db() -> list:
    """torch's OpInfo database (from its internal testing package)."""
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def set_custom_op_handler(op: OpOverload, handler: Callable | None) -> Callable | None:
    """Put `handler` in DTensor's table of ops that bypass its generic path (None removes it); returns the old one."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    previous = handlers.get(op)
    if handler is None:
        handlers.pop(op, None)
    else:
        handlers[op] = handler
    return previous


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


def propagate_and_redistribute(op_call: OpOverload, args: tuple, kwargs: dict) -> tuple[Any, Any, OpSchema]:
    """What DTensor's generic dispatch does before running the local kernel, for handlers that run their own.

    Returns (op_info with the redistributed local args, output sharding, the input schema the kernel runs on).
    """
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
    return op_info, sharding, schema


def wrap_local_results(local_results: object, output_spec: Any) -> object:
    return DTensor._op_dispatcher.wrap(local_results, output_spec)


def tp_convolution_kernels() -> tuple[Callable, Callable]:
    """torch's local convolution forward/backward runners (they exchange halos when a spatial dim is sharded)."""
    from torch.distributed.tensor._tp_conv import tp_convolution, tp_convolution_backward

    return tp_convolution, tp_convolution_backward


def min_cost_selector() -> Callable:
    """The function DTensor's propagator calls to pick one of an op's strategies for the given input specs."""
    return _sharding_prop_module._select_min_cost_strategy


def set_min_cost_selector(select: Callable) -> None:
    _sharding_prop_module._select_min_cost_strategy = select


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


def per_simulated_rank(func: Callable) -> Callable:
    """`func` run once per simulated rank on that rank's values under LocalTensorMode; unchanged outside it."""
    from torch.distributed._local_tensor import maybe_run_for_local_tensor

    return maybe_run_for_local_tensor(func)


def redistribute_costs(source: OpStrategy, target: DTensorSpec) -> list[float]:
    """torch's cost of moving each of `source`'s layouts to `target` (one OpSpec's redistribute_cost row)."""
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    return generate_redistribute_costs(source, target)


def op_strategy_func(op: OpOverload) -> Callable | None:
    """The op_strategy function torch registered for `op`, or None."""
    return propagator().op_strategy_funcs.get(op)


def register_op_strategy(op: OpOverload, func: Callable, *, schema_info: RuntimeSchemaInfo | None = None) -> None:
    """Register `func(strategy_schema) -> OpStrategy` as `op`'s op_strategy function in torch's table."""
    propagator().register_op_strategy(op, func, schema_info)


def expand_sharding(placements: Sequence[Placement], input_shape: Sequence[int], sizes: Sequence[int], mesh_sizes):
    """torch's view-op propagation for `expand` (input target placements, output placements); may raise."""
    from torch.distributed.tensor._ops import _view_ops

    rule = _view_ops.expand(tuple(input_shape), tuple(sizes))
    return _view_ops.propagate_shape_and_sharding(placements, tuple(input_shape), rule, tuple(mesh_sizes))


def register_view_strategy(op: OpOverload, torch_function: Callable, *, schema_info: RuntimeSchemaInfo | None) -> None:
    """Give `op` torch's view-op strategy for `torch_function`'s dim map, redistributing where a dim cannot stay
    sharded (the non-strict form torch uses for reshape and view_copy)."""
    from torch.distributed.tensor._ops import _view_ops

    _view_ops.register_op_strategy_map(op, torch_function, schema_info=schema_info, strict_view=False)


def squeeze_dims_variants() -> dict | None:
    """DTensor's table of squeeze ops whose dims it rewrites to the GLOBAL size-1 dims before the local call
    (so that a shard whose local size is 1 is not squeezed); None on a torch without it."""
    return getattr(propagator(), "squeeze_op_to_dims_variant", None)


def unbind_refuses_sharded_dim() -> bool:
    """Whether torch's sharding propagation refuses unbind along a sharded dim instead of replicating it (feature
    check: unbind(0) of a [2, 2] tensor placed Shard(0) on a 2-rank probe mesh)."""
    x = torch.zeros(2, 2)
    return not propagates(torch.ops.aten.unbind.int, (probe_spec(x, (Shard(0),)), 0))


def view_groups_drops_empty_dims() -> bool:
    """Whether torch's view dim mapping loses a size-0 dim in an identity view (feature check; the hanging
    cases are not probed)."""
    from torch.distributed.tensor._ops import _view_ops

    return _view_ops.view_groups((0, 4), (0, 4)) != (_view_ops.InputDim(0), _view_ops.InputDim(1))


def known_equal(value: Any, constant: int) -> bool:
    """`value == constant` where that is known without guarding on a symbolic size (False where unknown)."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return bool(guard_or_false(value == constant))


def output_tensor_meta(strategy_schema: OpSchema):
    """The global output TensorMeta(s) of the op in `strategy_schema` (tensor args as OpStrategy), as torch's
    propagator computes them before expanding a single-dim rule."""
    def as_spec(x):  # (TupleStrategy is a pytree node of its own: a list argument is rebuilt by hand)
        if isinstance(x, OpStrategy):
            return x.strategies[0].output_spec
        if isinstance(x, TupleStrategy):  # a list of tensors (indices, tensor lists)
            return [as_spec(child) for child in x.children]
        if isinstance(x, (list, tuple)):  # a list with None entries stays a plain list
            return type(x)(as_spec(child) for child in x)
        return x

    args = tuple(as_spec(a) for a in strategy_schema.args_schema)
    kwargs = {k: as_spec(v) for k, v in strategy_schema.kwargs_schema.items()}
    return propagator()._propagate_tensor_meta_non_cached(OpSchema(strategy_schema.op, args, kwargs))


def local_shapes(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> list[tuple]:
    """Every rank's local shape of a tensor of global `shape` placed so on a mesh of `mesh_shape` (torch's own
    chunking, strided shards included)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return [
        _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements, skip_offset=True)[0]
        for coordinate in itertools.product(*(range(n) for n in mesh_shape))
    ]


def outside_dispatch_modes():
    """Context in which ops run torch's real kernels even under an active dispatch mode (fake, LocalTensor)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def dispatch_redistributor() -> Callable:
    """The function DTensor's dispatcher calls to move one local input to the layout a strategy asks for."""
    from torch.distributed.tensor import _dispatch

    return _dispatch.redistribute_local_tensor


def set_dispatch_redistributor(redistribute: Callable) -> None:
    from torch.distributed.tensor import _dispatch

    _dispatch.redistribute_local_tensor = redistribute


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

    x = torch.zeros(2, 2)
    try:  # rank 0 holds row 0; the move is local, so the probe mesh needs no process group
        with outside_simulated_ranks():
            redistribute_local_tensor(x[:1], probe_spec(x, (Shard(0),)), probe_spec(x, (target,)))
    except RuntimeError:
        return False
    return True


def wrap_single_dim_func(op: OpOverload, wrap: Callable[[Callable], Callable]) -> None:
    """Make `wrap(torch's rule)` the single-dim rule of `op`, keeping everything torch registered along with it
    (its uneven/unbacked sharding flags; the schema info sits in its own table and is not touched)."""
    table = propagator().op_single_dim_strategy_funcs
    info = table[op]
    table[op] = dataclasses.replace(info, func=wrap(info.func)) if dataclasses.is_dataclass(info) else wrap(info)


def inplace_placement_refusal() -> bool:
    """Whether torch refuses an in-place copy into a tensor with an empty shard from a source in another layout
    (its N-D expansion drops the candidate that moves the source to the layout with the empty shard). Feature
    check: `self.copy_(src)`, [1, 2] tensors, `self` Shard(0) on a 2-rank probe mesh, `src` replicated."""
    self_, src = torch.zeros(1, 2), torch.zeros(1, 2)
    args = (probe_spec(self_, (Shard(0),)), probe_spec(src, (Replicate(),)))
    return not propagates(torch.ops.aten.copy_.default, args)


def rank_results_combiner() -> Callable:
    """The function LocalTensorMode calls to combine the per-rank results of an op into one value."""
    from torch.distributed import _local_tensor

    return _local_tensor._combine_any_rank_results


def set_rank_results_combiner(combine: Callable) -> None:
    from torch.distributed import _local_tensor

    _local_tensor._combine_any_rank_results = combine


def registered_strategy(op: OpOverload) -> object | None:
    """What the propagator runs for `op`: its single-dim record, else its op_strategy function."""
    prop = propagator()
    return prop.op_single_dim_strategy_funcs.get(op) or prop.op_strategy_funcs.get(op)


# --- fast propagation ---


def full_mesh_strategy_filter(prepared) -> Callable | None:
    """The rule's full-mesh filter `(mesh, op_schema, input_specs, output_specs) -> bool` (torch 2.14+), or None
    where the rule has none or the running torch has no such filters."""
    return getattr(prepared, "full_mesh_strategy_filter", None)


# --- newest torch (issue 13): behaviour probes for the torch fixes' feature checks ---


def probe_mesh(shape: Sequence[int]):
    """A mesh of `shape` as rank 0 sees it, with no process group behind it: enough for sharding propagation on a
    tiny input (nothing is communicated), so feature checks run before or without any process group."""
    from torch.distributed.device_mesh import DeviceMesh

    with outside_simulated_ranks():
        return DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(tuple(shape)), _init_backend=False, _rank=0)


@contextlib.contextmanager
def outside_simulated_ranks():
    """Context in which a probe mesh is an ordinary mesh also under LocalTensorMode (which patches DeviceMesh to
    answer for its simulated ranks)."""
    mode = enabled_local_tensor_mode()
    with mode.disable() if mode is not None else contextlib.nullcontext():
        yield


def probe_spec(t: torch.Tensor, placements: Sequence[Placement], mesh_shape: Sequence[int] = (2,)) -> DTensorSpec:
    """`t`'s spec placed so on a probe mesh of `mesh_shape`."""
    return DTensorSpec(probe_mesh(mesh_shape), tuple(placements), tensor_meta=tensor_meta(t))


def propagates(op: OpOverload, args: tuple, kwargs: dict | None = None) -> bool:
    """Whether torch's sharding propagation (both caches bypassed) finds a strategy for `op` on `args`, whose tensor
    arguments are DTensorSpecs."""
    return output_placements(op, args, kwargs) is not None


def output_placements(op: OpOverload, args: tuple, kwargs: dict | None = None) -> tuple | None:
    """The placements torch's sharding propagation (both caches bypassed) gives `op`'s first output for `args`
    (tensor arguments as DTensorSpecs); None where it refuses (a RuntimeError, an assertion, or 2.13's ValueError
    for output specs that do not match the op's outputs)."""
    try:
        with outside_simulated_ranks():
            output = propagate_cold(OpSchema(op, tuple(args), dict(kwargs or {}))).output_spec
    except (RuntimeError, AssertionError, KeyError, ValueError):
        return None
    return (output[0] if isinstance(output, (tuple, list)) else output).placements


def schema_info(op: OpOverload) -> RuntimeSchemaInfo | None:
    """The runtime schema info torch registered with `op`'s strategy (which args are static, whether list args
    hold tensors), as DTensor's dispatcher attaches it to the OpSchema it propagates."""
    prop = propagator()
    return prop.op_to_schema_info_for_single_dim_strategy.get(op) or prop.op_to_schema_info.get(op)


# --- hf (issue 14: model zoo, losses, coverage) ---
from torch.distributed.tensor.placement_types import _MaskPartial as MaskPartial  # noqa: E402


def output_meta_computer() -> Callable:
    """The function DTensor's propagator calls to derive an op's global output metadata from fake inputs."""
    return propagator()._propagate_tensor_meta_non_cached


def set_output_meta_computer(compute: Callable | None) -> None:
    """Make `compute(op_schema)` the propagator's output-metadata function (None: back to its class's own)."""
    if compute is None:
        vars(propagator()).pop("_propagate_tensor_meta_non_cached", None)
    else:
        propagator()._propagate_tensor_meta_non_cached = compute


# --- sequence-parallel passes (dtensor_ext/passes) ---


def inductor_joint_pass_slot() -> tuple[Any, str]:
    """(inductor's config, the name of its joint-graph custom pass slot). That pass sees AOTAutograd's joint
    forward+backward graph before the partitioner splits it (and the inference graph when nothing needs grad)."""
    import torch._inductor.config as config

    if not hasattr(config, "joint_custom_pre_pass"):
        raise RuntimeError(f"torch {torch.__version__}: inductor has no joint_custom_pre_pass slot to install into")
    return config, "joint_custom_pre_pass"


def size_hint(size: Any) -> int:
    """An int or SymInt's example value, without installing a guard on it."""
    if isinstance(size, int):
        return size
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # torch 2.12
        return size.node.hint
    return optimization_hint(size)


# --- redistribution planner (dtensor_ext.redistribute): sub-mesh coordinates and DTensor's redistribution hook ---
_REDISTRIBUTE_CALLERS = ("_redistribute", "_dispatch", "_api")  # modules calling redistribute_local_tensor by name


def mesh_coordinates_by_rank(mesh) -> dict[int, tuple[int, ...]]:
    """Global rank -> its coordinate in `mesh` (every simulated rank under LocalTensorMode, where a sub-mesh stands
    for the slice each rank belongs to; only this rank otherwise); empty where this rank is not in `mesh`."""
    import torch.distributed as dist

    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return {}
    mode = enabled_local_tensor_mode()
    if mode is None:
        return {dist.get_rank(): tuple(int(c) for c in coordinate)}

    def on(c, rank: int) -> int:
        node = getattr(c, "node", None)
        if node is None:
            return int(c)
        values = getattr(node, "_local_ints", None)
        return values[rank] if values is not None else node.maybe_as_int()  # the same on every rank

    return {rank: tuple(on(c, rank) for c in coordinate) for rank in sorted(mode.ranks)}


def flattened_mesh(mesh, mesh_dims: tuple[int, ...]):
    """A 1-D mesh over `mesh_dims` of `mesh` (row-major), reusing one DeviceMesh._flatten made before; None where the
    mesh has no dim names (torch cannot flatten it)."""
    if mesh.mesh_dim_names is None:
        return None
    names = tuple(mesh.mesh_dim_names[d] for d in mesh_dims)
    return mesh[names]._flatten("_".join(("dtensor_ext", *names)))


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


# --- newest torch (issue 13, continued): feature checks that run real DTensor ops on a probe mesh ---


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
