"""Copying variants of views (`permute_copy`, `t_copy`, `transpose_copy`, `unsqueeze_copy`, `unfold_copy`,
`narrow_copy`, `alias_copy`), which torch 2.13 has no strategy for.

DTensor runs them through its decomposition fallback, which gathers a sharded dim that the view only moves and
turns every Partial input into a Replicate one. Each output element is a copy of exactly one input element, so:

* a dim the op only relabels (moves, keeps) shards in the input and the output alike, evenly or not;
* every Partial reduction (sum, avg, max, min) passes through, since the op commutes with any elementwise
  reduction over ranks;
* a dim the op cuts into (narrow's dim, unfold's windowed dim) stays whole: a rank's piece does not hold the
  elements the global start or window positions pick.

Each rule is the op's dim relabelling written as a factor signature: lowercase letters for the input's dims and
the output dims they become, an uppercase letter for an output dim made anew (never sharded).
"""

from __future__ import annotations

from string import ascii_lowercase

from dtensor_ext._compat import RuntimeSchemaInfo
from dtensor_ext.registry import single_dim_rule
from dtensor_ext.rules.factors import factor_strategies

FAMILY = "copies"

# every reduction commutes with moving or repeating elements
DATA_MOVEMENT_REDUCTIONS = ("sum", "avg", "max", "min")


def moved(signature: str, meta) -> list[list]:
    """Rows for an op that only moves elements of one input: shared letters shard, every Partial passes."""
    return factor_strategies(signature, [meta], contracted_reductions=(), linear_reductions=DATA_MOVEMENT_REDUCTIONS)


def _dims(meta) -> str:
    return ascii_lowercase[: len(meta.shape)]


def _wrap(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


@single_dim_rule("aten::alias_copy", family=FAMILY)
def alias_copy_rule(op, args, kwargs):
    dims = _dims(args[0])
    return moved(f"{dims}->{dims}", args[0])


@single_dim_rule("aten::permute_copy", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def permute_copy_rule(op, args, kwargs):
    """Output dim i is input dim dims[i]."""
    self, order = args[0], args[1]
    dims = _dims(self)
    return moved(f"{dims}->{''.join(dims[_wrap(d, len(dims))] for d in order)}", self)


@single_dim_rule("aten::t_copy", family=FAMILY)
def t_copy_rule(op, args, kwargs):
    """0-d and 1-d inputs come back as they are; 2-d ones transposed."""
    dims = _dims(args[0])
    return moved(f"{dims}->{dims[::-1]}", args[0])


@single_dim_rule("aten::transpose_copy.int", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def transpose_copy_rule(op, args, kwargs):
    self, dim0, dim1 = args[:3]
    dims = list(_dims(self))
    if dims:
        i, j = _wrap(dim0, len(dims)), _wrap(dim1, len(dims))
        dims[i], dims[j] = dims[j], dims[i]
    return moved(f"{_dims(self)}->{''.join(dims)}", self)


@single_dim_rule("aten::unsqueeze_copy", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def unsqueeze_copy_rule(op, args, kwargs):
    """The new size-1 dim (N) is inserted at `dim` of the output."""
    self, dim = args[0], args[1]
    dims = _dims(self)
    at = dim % (len(dims) + 1)
    return moved(f"{dims}->{dims[:at]}N{dims[at:]}", self)


@single_dim_rule("aten::unfold_copy", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def unfold_copy_rule(op, args, kwargs):
    """(self, dimension, size, step): `dimension` becomes the window count (W), a window dim (S) is appended."""
    self, dimension = args[0], args[1]
    dims = _dims(self)
    if not dims:  # a 0-d input unfolds into one window of size 1
        return moved("->S", self)
    at = _wrap(dimension, len(dims))
    return moved(f"{dims}->{dims[:at]}W{dims[at + 1:]}S", self)


@single_dim_rule("aten::narrow_copy", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def narrow_copy_rule(op, args, kwargs):
    """(self, dim, start, length): `dim` becomes a new dim of `length` (L)."""
    self, dim = args[0], args[1]
    dims = _dims(self)
    at = _wrap(dim, len(dims))
    return moved(f"{dims}->{dims[:at]}L{dims[at + 1:]}", self)
