"""The one door to torch internals.

Every private torch import and every version/feature check lives here, so that a torch release that moves
something breaks exactly one module. Features are detected by keyword or attribute, never by version string
alone: CI runs 2.13, the GPU machine 2.11, and 2.12-2.15 must keep working.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._ops import OpOverload
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, RuntimeSchemaInfo
from torch.distributed.tensor._ops import single_dim_strategy as _sds
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
)


def snapshot_registration(op: OpOverload) -> dict[str, Any]:
    """Everything the propagator knows about `op`, so that it can be put back exactly."""
    prop = propagator()
    return {t: getattr(prop, t)[op] for t in _REGISTRATION_TABLES if op in getattr(prop, t)}


def restore_registration(op: OpOverload, snapshot: dict[str, Any]) -> None:
    prop = propagator()
    for table in _REGISTRATION_TABLES:
        entries = getattr(prop, table)
        if table in snapshot:
            entries[op] = snapshot[table]
        else:
            entries.pop(op, None)


def single_dim_func(op: OpOverload) -> Callable | None:
    """The raw rule function registered for `op` (unwrapping torch's info record where there is one)."""
    info = propagator().op_single_dim_strategy_funcs.get(op)
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


def dtensor_collective_costs():
    """torch's own cost formulas for collectives (microseconds) and its topology record, for comparison."""
    from torch.distributed.tensor import _collective_utils as cu

    return cu.MeshTopoInfo, {"all_gather": cu.allgather_cost, "all_reduce": cu.allreduce_cost,
                             "reduce_scatter": cu.reduce_scatter_cost}


def enabled_local_tensor_mode():
    """The active LocalTensorMode (simulated ranks) or None in a real multi-process run."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode as enabled

    return enabled()


def local_int(values: dict[int, int]):
    """One int per simulated rank, as a SymInt collectives and views accept."""
    from torch.distributed._local_tensor import LocalIntNode

    return torch.SymInt(LocalIntNode(values))
