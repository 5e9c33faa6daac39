"""Reductions and scans: a dim that survives may be sharded; a reduced dim only where the partial results combine.

A sharded reduced dim gives a Partial output exactly when the reduction of per-rank results is one DTensor can
finish (count_nonzero: sum of counts; aminmax: Partial(min) and Partial(max)). A kernel that raises on an empty input
(aminmax) must not see an empty shard of a reduced dim, which DTensor's uneven chunking can leave a rank (5 rows on 4
ranks: 2, 2, 1, 0); a single-dim rule does not see the mesh, so `torch_fixes.empty_shards` drops those layouts.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtensor_ext._compat import NormPartial, Partial, RuntimeSchemaInfo, ShardingPlaceholder
from dtensor_ext.registry import single_dim_rule

FAMILY = "reductions"


def reduced_dims(ndim: int, dim: int | Sequence[int] | None) -> list[int]:
    """The dims a reduction removes; None or [] means all of them (0-d inputs reduce their one implicit dim)."""
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % max(ndim, 1) for d in dims} & set(range(ndim)))


def surviving_rows(ndim: int, reduced: Sequence[int], keepdim: bool, n_outputs: int = 1) -> list[list]:
    """Shard a dim the reduction keeps: it is output dim d (keepdim) or d less the reduced dims before it."""
    rows = []
    for d in range(ndim):
        if d in reduced:
            continue
        out = d if keepdim else d - sum(1 for r in reduced if r < d)
        rows.append([*([ShardingPlaceholder(out)] * n_outputs), ShardingPlaceholder(d)])
    return rows


@single_dim_rule(["aten::count_nonzero", "aten::count_nonzero.dim_IntList"], family=FAMILY,
                 schema_info=RuntimeSchemaInfo(1))
def count_nonzero_rule(op, args, kwargs):
    """Counts add up: a sharded reduced dim gives Partial(sum) (an empty shard counts 0)."""
    self = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    ndim = len(self.shape)
    reduced = reduced_dims(ndim, dim)
    rows = surviving_rows(ndim, reduced, keepdim=False)
    return rows + [[Partial("sum"), ShardingPlaceholder(d)] for d in reduced]


@single_dim_rule("aten::aminmax", family=FAMILY, schema_info=RuntimeSchemaInfo(1, static_kwargkey=["dim", "keepdim"]))
def aminmax_rule(op, args, kwargs):
    """(min, max) over `dim` (or everything): surviving dims shard, and a sharded reduced dim gives the per-rank
    (min, max) as (Partial(min), Partial(max)), as torch's own path through amin and amax does. A rank left an empty
    shard of a reduced dim would make the kernel raise: `torch_fixes.empty_shards` drops those layouts."""
    self = args[0]
    ndim = len(self.shape)
    reduced = reduced_dims(ndim, kwargs.get("dim"))
    rows = surviving_rows(ndim, reduced, kwargs.get("keepdim", False), n_outputs=2)
    return rows + [[Partial("min"), Partial("max"), ShardingPlaceholder(d)] for d in reduced]


@single_dim_rule("aten::hash_tensor", family=FAMILY,
                 schema_info=RuntimeSchemaInfo(1, static_kwargkey=["keepdim", "mode"]))
def hash_tensor_rule(op, args, kwargs):
    """An xor-fold of the bits over `dim`: no Partial can finish it, so only surviving dims shard."""
    self = args[0]
    ndim = len(self.shape)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", [])
    return surviving_rows(ndim, reduced_dims(ndim, dim), kwargs.get("keepdim", False))


@single_dim_rule("aten::logsumexp", family=FAMILY, schema_info=RuntimeSchemaInfo(1, static_kwargkey=["keepdim"]),
                 superset_of_torch=True)
def logsumexp_rule(op, args, kwargs):
    """log(sum(exp)) over `dim`: surviving dims shard, mapped through keepdim however it was passed."""
    self = args[0]
    ndim = len(self.shape)
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return surviving_rows(ndim, reduced_dims(ndim, args[1]), keepdim)


@single_dim_rule("aten::cumsum", family=FAMILY, schema_info=RuntimeSchemaInfo(1, static_kwargkey=["dtype"]),
                 superset_of_torch=True)
def cumsum_rule(op, args, kwargs):
    """Running sums are linear: other dims shard, and a Partial sum (or avg) input stays Partial."""
    self, dim = args[0], args[1]
    ndim = len(self.shape)
    scanned = dim % max(ndim, 1)
    rows = [[ShardingPlaceholder(d), ShardingPlaceholder(d)] for d in range(ndim) if d != scanned]
    return rows + [[Partial(r), Partial(r)] for r in ("sum", "avg")]



# p-norms whose per-shard values add up to the norm, also over empty shards (whose norm is 0): p=0 counts the
# nonzero entries, p=1 sums |x|. Other positive finite orders combine through DTensor's p-norm Partial
# ((sum of v ** p) ** (1 / p); an empty shard's norm 0 adds nothing), as torch's own path through
# linalg_vector_norm does. inf and negative orders raise on the empty shard uneven sharding can leave a rank with.
_ADDITIVE_NORM_ORDERS = (0.0, 1.0)


def _reduced_norm_partial(p: float):
    """The Partial a reduced dim's per-shard p-norms make, or None where no shard may be reduced on its own."""
    if p in _ADDITIVE_NORM_ORDERS:
        return Partial("sum")
    return NormPartial(p) if 0 < p < float("inf") else None


@single_dim_rule(["aten::norm.ScalarOpt_dim", "aten::norm.ScalarOpt_dim_dtype"], family=FAMILY,
                 schema_info=RuntimeSchemaInfo(1, static_kwargkey=["keepdim", "dtype"]))
def norm_over_dims_rule(op, args, kwargs):
    """(self, p, dim, keepdim) p-norm over `dim` (F.pairwise_distance's kernel): surviving dims shard; a reduced
    dim shards into Partial(sum) for the additive orders and the p-norm Partial for other positive finite orders.
    Not linear: a Partial input does not pass."""
    self = args[0]
    p = args[1] if len(args) > 1 and args[1] is not None else 2.0
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    ndim = len(self.shape)
    reduced = reduced_dims(ndim, args[2])
    rows = surviving_rows(ndim, reduced, keepdim)
    partial = _reduced_norm_partial(float(p))
    if partial is not None:
        rows += [[partial, ShardingPlaceholder(d)] for d in reduced]
    return rows
