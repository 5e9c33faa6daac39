"""Indexing and scatter ops torch 2.13 cannot shard.

Three facts carry every rule here:

* index values are global positions, so the indexed dim of the destination is never sharded; a dim the op
  does not index may be sharded alike in every operand that spans it;
* a *selection* (each output element is a copy of an input element chosen by the indices alone: take,
  index_copy, masked_scatter, put without accumulate) commutes with every Partial kind: reduce the copies or
  copy the reduction, the same elements meet;
* an *accumulation* (index_add, scatter add/sum, put with accumulate) is linear: source and indices sharded alike
  along the scattered dim give each rank a part of the sum, i.e. a Partial(sum) output when the destination
  counts once (Partial(sum) itself);
* avg, max and min are idempotent: a replicated operand is already a valid Partial of those kinds, so an operand
  the op is affine (avg) or monotone (max, min) in may be Partial alone while the others stay replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtensor_ext._compat import Partial, Replicate, RuntimeSchemaInfo
from dtensor_ext._compat import ShardingPlaceholder as S
from dtensor_ext.registry import single_dim_rule

FAMILY = "indexing"

R = Replicate
SELECTION_REDUCTIONS = ("sum", "avg", "max", "min")
LINEAR_REDUCTIONS = ("sum", "avg")
IDEMPOTENT_REDUCTIONS = ("avg", "max", "min")


def _floating(meta) -> bool:
    return meta.dtype.is_floating_point or meta.dtype.is_complex


def _partial_kinds(meta, kinds):
    """Partial kinds that are exact for this dtype (avg needs division)."""
    return [k for k in kinds if k != "avg" or _floating(meta)]


def _splits(size: int) -> bool:
    """Whether splitting a dim of this size into parts of a sum is worth a row: a size-1 dim puts the whole
    tensor on one rank, which torch's validator reads as a replicated tensor and then rejects the row."""
    return size > 1


def _dim(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


@single_dim_rule("aten::index_add", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def index_add_rule(op, args, kwargs):
    """out = self; out.select(dim, index[i]) += alpha * source.select(dim, i)."""
    self, dim, index, source = args[:4]
    ndim = len(self.shape)
    dim = _dim(dim, ndim)
    rows = [[S(d), S(d), R(), S(d)] for d in range(ndim) if d != dim]
    if ndim and _splits(index.shape[0]):  # each rank adds its slice of source: parts of one sum
        rows.append([Partial("sum"), Partial("sum"), S(0), S(dim)])
    rows += [[Partial(k), Partial(k), R(), Partial(k)] for k in _partial_kinds(self, LINEAR_REDUCTIONS)]
    # self_r + c is affine and monotone in self_r; self + alpha * source_r is affine in source_r
    rows += [[Partial(k), Partial(k), R(), R()] for k in _partial_kinds(self, IDEMPOTENT_REDUCTIONS)]
    rows += [[Partial(k), R(), R(), Partial(k)] for k in _partial_kinds(self, ("avg",))]
    return rows


@single_dim_rule("aten::index_copy", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def index_copy_rule(op, args, kwargs):
    """out = self; out.select(dim, index[i]) = source.select(dim, i): a selection."""
    self, dim, index, source = args[:4]
    ndim = len(self.shape)
    dim = _dim(dim, ndim)
    rows = [[S(d), S(d), R(), S(d)] for d in range(ndim) if d != dim]
    return rows + _selection_partial_rows(self, [R()])


def _selection_partial_rows(self, middle):
    """[out, self, *middle, source] rows of a selection from self and source: Partial alike, or one of them
    Partial of an idempotent kind with the other replicated."""
    rows = [[Partial(k), Partial(k), *middle, Partial(k)] for k in _partial_kinds(self, SELECTION_REDUCTIONS)]
    for k in _partial_kinds(self, IDEMPOTENT_REDUCTIONS):
        rows += [[Partial(k), Partial(k), *middle, R()], [Partial(k), R(), *middle, Partial(k)]]
    return rows


def _scatter_aligned_dims(self, index, src, dim):
    """Dims other than `dim` where self, index and src have one size, so their shards line up."""
    return [
        d
        for d in range(len(self.shape))
        if d != dim and self.shape[d] == index.shape[d] == src.shape[d]
    ]


@dataclass(frozen=True)
class _ScatterAlgebra:
    """Which Partial kinds pass through a scatter reduction (self, src and the reduced output)."""

    both: tuple[str, ...]  # self and src Partial alike (the reduction is linear / commutes with the kind)
    self_only: tuple[str, ...]  # self Partial, src replicated: the result is affine or monotone in self
    src_only: tuple[str, ...]  # src Partial, self replicated
    split: str | None  # the output kind when index and src are split along the scattered dim (with include_self)


_SCATTER_ALGEBRA = {
    "sum": _ScatterAlgebra(("sum", "avg"), ("avg", "max", "min"), ("avg",), "sum"),
    "mean": _ScatterAlgebra(("sum", "avg"), ("avg", "max", "min"), ("avg",), None),  # counts are per position
    "amax": _ScatterAlgebra(("max",), ("max", "min"), ("max",), "max"),
    "amin": _ScatterAlgebra(("min",), ("max", "min"), ("min",), "min"),
    "prod": _ScatterAlgebra((), ("avg",), (), None),  # no Partial(prod) placement exists
}


def scatter_rows(self, dim, index, src, reduce, include_self):
    ndim = len(self.shape)
    dim = _dim(dim, ndim)
    algebra = _SCATTER_ALGEBRA[reduce]
    rows = [[S(d), S(d), S(d), S(d)] for d in _scatter_aligned_dims(self, index, src, dim)]
    both, self_only, src_only = algebra.both, algebra.self_only, algebra.src_only
    if reduce == "prod" and include_self:  # self * prod(src) is linear in self
        self_only = ("sum", "avg")
    if reduce == "mean" and not _floating(self):  # integer mean floors each part
        both, self_only, src_only = (), ("max", "min"), ()
    rows += [[Partial(k), Partial(k), R(), Partial(k)] for k in _partial_kinds(self, both)]
    rows += [[Partial(k), Partial(k), R(), R()] for k in _partial_kinds(self, self_only)]
    rows += [[Partial(k), R(), R(), Partial(k)] for k in _partial_kinds(self, src_only)]
    split = algebra.split
    if split and include_self and ndim and index.shape[dim] == src.shape[dim] and _splits(index.shape[dim]):
        # positions no shard scatters to keep self on every rank, which only sum must not count twice
        rows.append([Partial(split), Partial(split), S(dim), S(dim)])
        if split != "sum":
            rows.append([Partial(split), R(), S(dim), S(dim)])
    return rows


@single_dim_rule(
    "aten::scatter_reduce.two", family=FAMILY, schema_info=RuntimeSchemaInfo(1, static_kwargkey=["include_self"])
)
def scatter_reduce_rule(op, args, kwargs):
    self, dim, index, src, reduce = args[:5]
    include_self = kwargs.get("include_self", True) if len(args) < 6 else args[5]
    return scatter_rows(self, dim, index, src, reduce, include_self)


@single_dim_rule("aten::scatter.reduce", family=FAMILY, schema_info=RuntimeSchemaInfo(1, static_kwargkey=["reduce"]))
def scatter_legacy_reduce_rule(op, args, kwargs):
    """The legacy reduce="add"/"multiply" spelling: scatter_reduce with include_self."""
    self, dim, index, src = args[:4]
    reduce = {"add": "sum", "multiply": "prod"}[kwargs["reduce"]]
    return scatter_rows(self, dim, index, src, reduce, include_self=True)


@single_dim_rule(
    "aten::scatter.value_reduce", family=FAMILY, schema_info=RuntimeSchemaInfo(1, static_kwargkey=["reduce"])
)
def scatter_value_reduce_rule(op, args, kwargs):
    """One number scattered with reduce="add" (self plus value per hit: affine in self, and index split along dim
    adds each rank's hits to its part of a Partial(sum) self) or "multiply" (self times value per hit: linear)."""
    self, dim, index = args[:3]
    dim = _dim(dim, len(self.shape))
    adds = kwargs["reduce"] == "add"
    rows = [[S(d), S(d), S(d)] for d in range(len(self.shape)) if d != dim and self.shape[d] == index.shape[d]]
    kinds = ("avg", "max", "min") if adds else ("sum", "avg")
    rows += [[Partial(k), Partial(k), R()] for k in _partial_kinds(self, kinds)]
    if adds and len(self.shape) and _splits(index.shape[dim]):
        rows.append([Partial("sum"), Partial("sum"), S(dim)])
    return rows


@single_dim_rule("aten::masked_scatter", family=FAMILY)
def masked_scatter_rule(op, args, kwargs):
    """Source elements are consumed in row-major order of the mask, so only Partial values pass through."""
    self, mask, source = args[:3]
    return _selection_partial_rows(self, [R()])


@single_dim_rule("aten::take", family=FAMILY)
def take_rule(op, args, kwargs):
    """out[i] = self.flatten()[index[i]]: out follows the index; a selection of self."""
    self, index = args[:2]
    rows = [[S(d), R(), S(d)] for d in range(len(index.shape))]
    rows += [[Partial(k), Partial(k), R()] for k in _partial_kinds(self, SELECTION_REDUCTIONS)]
    return rows


@single_dim_rule("aten::put", family=FAMILY, schema_info=RuntimeSchemaInfo(3))
def put_rule(op, args, kwargs):
    """out = self.flatten(); out[index] = source (or += with accumulate)."""
    self, index, source = args[:3]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if not accumulate:
        return _selection_partial_rows(self, [R()])
    rows = [[Partial(k), Partial(k), R(), Partial(k)] for k in _partial_kinds(self, LINEAR_REDUCTIONS)]
    rows += [[Partial(k), Partial(k), R(), R()] for k in _partial_kinds(self, IDEMPOTENT_REDUCTIONS)]
    rows += [[Partial(k), R(), R(), Partial(k)] for k in _partial_kinds(self, ("avg",))]
    if tuple(index.shape) == tuple(source.shape):
        rows += [[Partial("sum"), Partial("sum"), S(d), S(d)] for d, n in enumerate(index.shape) if _splits(n)]
    return rows


@single_dim_rule(
    "aten::searchsorted.Tensor", family=FAMILY, schema_info=RuntimeSchemaInfo(static_kwargkey=["side", "sorter"])
)
def searchsorted_rule(op, args, kwargs):
    """Each value is searched in its own row of the sorted sequence (or in the one 1-D sequence)."""
    seq, values = args[:2]
    sorter = kwargs.get("sorter")
    ndim = len(values.shape)
    one_sequence = len(seq.shape) == 1
    rows = []
    for d in range(ndim):
        along_rows = not one_sequence and d < ndim - 1  # a batch dim of both: shard the rows with the values
        shared = S(d) if along_rows else R()
        rows.append([S(d), shared, S(d), *([shared] if sorter is not None else [])])
    replicated_sorter = [R()] if sorter is not None else []
    # the position only grows with the value, so it commutes with max and min of the values
    rows += [[Partial(k), R(), Partial(k), *replicated_sorter] for k in ("max", "min")]
    if sorter is None and _splits(seq.shape[-1]):
        # the position is a count of smaller elements: each shard of a sorted row counts its own
        rows.append([Partial("sum"), S(len(seq.shape) - 1), R()])
    return rows


@single_dim_rule(
    "aten::searchsorted.Scalar", family=FAMILY, schema_info=RuntimeSchemaInfo(static_kwargkey=["side", "sorter"])
)
def searchsorted_scalar_rule(op, args, kwargs):
    """One value searched in a 1-D sorted sequence (torch takes a number only there): its position is a count of
    smaller elements, and each shard of the sorted sequence counts its own."""
    seq = args[0]
    if kwargs.get("sorter") is None and _splits(seq.shape[0]):
        return [[Partial("sum"), S(0)]]
    return []


def _index_layout(self, indices):
    """(indexed dims, broadcast index rank, where the index dims land in the result) as in advanced indexing."""
    indexed = [d for d, idx in enumerate(indices) if idx is not None]
    rank = max(len(indices[d].shape) for d in indexed)
    consecutive = all(b - a == 1 for a, b in zip(indexed, indexed[1:]))
    insert = indexed[0] if consecutive else 0
    return indexed, rank, insert


def _result_dim_of_self(d, indexed, rank, insert):
    return d if d < insert else d + rank - sum(1 for i in indexed if i < d)


def _follow_result_dim(meta, out_dim, out_ndim):
    """Placement of a tensor broadcast against the result when the result is sharded on out_dim."""
    d = out_dim - (out_ndim - len(meta.shape))
    if d < 0 or meta.shape[d] == 1:
        return R()
    return S(d)


def _masked_index_rows(self, mask, indices, out_ndim):
    """Rows [out, self, mask, *indices] sharding a dim of self no index touches, or a broadcast index dim."""
    indexed, rank, insert = _index_layout(self, indices)
    present = [indices[d] for d in indexed]
    rows = []
    for d in range(len(self.shape)):
        if d in indexed:
            continue
        out_dim = _result_dim_of_self(d, indexed, rank, insert)
        rows.append([S(out_dim), S(d), _follow_result_dim(mask, out_dim, out_ndim), *(R() for _ in present)])
    for b in range(rank):
        out_dim = insert + b
        idx_places = [_follow_result_dim(idx, b, rank) for idx in present]
        if all(isinstance(p, Replicate) for p in idx_places):  # every index broadcasts here: nothing to split
            continue
        rows.append([S(out_dim), R(), _follow_result_dim(mask, out_dim, out_ndim), *idx_places])
    return rows


@single_dim_rule("aten::_unsafe_masked_index", family=FAMILY, schema_info=RuntimeSchemaInfo(3, needs_pytree=True),
                 allow_uneven_sharding=False)
def unsafe_masked_index_rule(op, args, kwargs):
    """where(mask, self[indices], fill): advanced indexing's shardable dims; fill counts once per rank.

    Even shards only: on an empty self the kernel returns a result of the wrong shape, and uneven shards can be
    empty."""
    self, mask, indices, fill = args[:4]
    indexed, rank, _ = _index_layout(self, indices)
    out_ndim = len(self.shape) - len(indexed) + rank
    rows = _masked_index_rows(self, mask, indices, out_ndim)
    n_idx = len(indexed)
    kinds = [k for k in _partial_kinds(self, SELECTION_REDUCTIONS) if k != "sum" or fill == 0]
    rows += [[Partial(k), Partial(k), R(), *(R() for _ in range(n_idx))] for k in kinds]
    return rows


@single_dim_rule(
    "aten::_unsafe_masked_index_put_accumulate", family=FAMILY, schema_info=RuntimeSchemaInfo(needs_pytree=True)
)
def unsafe_masked_index_put_accumulate_rule(op, args, kwargs):
    """self.index_put(indices, where(mask, values, 0), accumulate=True): linear in (self, values)."""
    self, mask, indices, values = args[:4]
    indexed, rank, insert = _index_layout(self, indices)
    present = [indices[d] for d in indexed]
    v_ndim = len(values.shape)
    rows = []
    for d in range(len(self.shape)):
        if d in indexed:
            continue
        v_dim = _result_dim_of_self(d, indexed, rank, insert)
        rows.append([S(d), S(d), _follow_result_dim(mask, v_dim, v_ndim), *(R() for _ in present),
                     _follow_result_dim(values, v_dim, v_ndim)])
    for b in range(rank):  # each rank accumulates the values of its slice of index positions
        v_dim = insert + b
        idx_places = [_follow_result_dim(idx, b, rank) for idx in present]
        if not _splits(values.shape[v_dim]) or all(isinstance(p, Replicate) for p in idx_places):
            continue
        rows.append([Partial("sum"), Partial("sum"), _follow_result_dim(mask, v_dim, v_ndim), *idx_places,
                     _follow_result_dim(values, v_dim, v_ndim)])
    rows += [[Partial(k), Partial(k), R(), *(R() for _ in present), Partial(k)]
             for k in _partial_kinds(self, LINEAR_REDUCTIONS)]
    return rows


_EMBEDDING_BAG_MAX = 2


@single_dim_rule(["aten::_embedding_bag", "aten::_embedding_bag_forward_only"], family=FAMILY,
                 schema_info=RuntimeSchemaInfo(3))
def embedding_bag_rule(op, args, kwargs):
    """Outputs (bags, offset2bag, bag_size, max_indices); every embedding column is reduced on its own.

    Sharding the embedding dim shards the bags and max_indices (per column); offset2bag and bag_size depend on the
    indices only. sum/mean bags are linear in the weight.

    torch 2.13's CPU kernel raises ("Expected i < index_size") on a table with no columns in sum/mean mode for
    every dtype but float64, and DTensor's chunking leaves a rank with no columns (5 columns on 4 ranks: 2,2,1,0).
    A rule cannot see the mesh size, so those modes shard the columns only for float64.
    """
    weight, indices, offsets = args[:3]
    mode = args[4] if len(args) > 4 else kwargs.get("mode", 0)
    per_sample_weights = args[6] if len(args) > 6 else kwargs.get("per_sample_weights")
    psw = [R()] if per_sample_weights is not None else []
    max_mode = mode == _EMBEDDING_BAG_MAX
    rows = []
    if max_mode or weight.dtype == torch.float64:
        rows.append([S(1), R(), R(), S(1) if max_mode else R(), S(1), R(), R(), *psw])
    if not max_mode:  # (under max the argmax of a Partial weight differs per rank)
        kinds = _partial_kinds(weight, LINEAR_REDUCTIONS)
        rows += [[Partial(k), R(), R(), R(), Partial(k), R(), R(), *psw] for k in kinds]
        if psw:  # the bag is also linear in its per-sample weights
            rows += [[Partial(k), R(), R(), R(), R(), R(), R(), Partial(k)] for k in kinds]
    return rows
