"""torch's DTensor types, placements and cost formulas, re-exported under the names the package uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol  # noqa: F401  (re-exported)
from torch._ops import OpOverload, OpOverloadPacket
from torch.distributed.tensor import DTensor  # noqa: F401  (re-exported)
from torch.distributed.tensor._collective_utils import (  # noqa: F401  (re-exported)
    MeshTopoInfo,
    allgather_cost,
    allreduce_cost,
    redistribute_cost,
    reduce_scatter_cost,
)
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401  (re-exported)
from torch.distributed.tensor._op_schema import (  # noqa: F401  (re-exported)
    OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo, TupleStrategy,
)
from torch.distributed.tensor._ops import single_dim_strategy as _sds
from torch.distributed.tensor._ops._math_ops import _NormPartial as NormPartial  # noqa: F401  (re-exported)
from torch.distributed.tensor._ops.utils import (  # noqa: F401  (re-exported)
    is_tensor_evenly_shardable, is_tensor_shardable,
)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401  (re-exported)
from torch.distributed.tensor.placement_types import (  # noqa: F401  (re-exported)
    Partial,
    Placement,
    Replicate,
    Shard,
    _MaskPartial as MaskPartial,
    _StridedShard,
)
from torch.utils import _pytree as pytree  # noqa: F401  (re-exported)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported)

try:  # LocalTensorMode appeared with the simulated-rank machinery (2.9+).
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode  # noqa: F401  (re-exported)
except ImportError as exc:  # pragma: no cover - only on torch too old for this package
    raise ImportError("dtensor_ext needs torch.distributed._local_tensor (torch >= 2.11)") from exc

TORCH_VERSION = torch.__version__.split("+")[0]
ShardingPlaceholder = _sds._ShardingPlaceholder
StridedShard = _StridedShard


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
