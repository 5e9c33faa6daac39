"""Matmul-like ops torch 2.13 cannot shard: products of operands summed over shared factors.

Each rule is its factor signature; the generator (`rules/factors.py`) turns it into single-dim strategies.
"""

from __future__ import annotations

from collections.abc import Callable

from dtensor_ext import _compat
from dtensor_ext._compat import OpSchema, OpSpec, RuntimeSchemaInfo
from dtensor_ext.registry import single_dim_rule
from dtensor_ext.rules.factors import factor_strategies

FAMILY = "matmul"


@single_dim_rule("aten::mv", family=FAMILY)
def mv_rule(op, args, kwargs):
    mat, vec = args[:2]
    return factor_strategies("mk,k->m", [mat, vec])


def addmv_pieces_keep_their_shape(bias_shape, mat_shape, mesh_shape, mat_placements) -> bool:
    """Whether addmv gives every rank a result of the shape its layout says. The kernel returns a broadcast bias's
    own shape for an empty matrix (addmv(b[1], m[0,k], v) and addmv(b[1], m[5,0], v[0]) both have shape [1]), so
    with a broadcast bias no rank may hold an empty piece of a non-empty matrix (uneven shards can be empty)."""
    if tuple(bias_shape) == (mat_shape[0],) or 0 in tuple(mat_shape):
        return True
    return all(0 not in tuple(local) for local in _compat.local_shapes(mat_shape, mesh_shape, mat_placements))


def _addmv_layouts(op_schema: OpSchema) -> Callable[[OpSpec], bool]:
    def keeps(spec: OpSpec) -> bool:
        bias, mat = spec.input_specs[:2]
        return addmv_pieces_keep_their_shape(bias.tensor_meta.shape, mat.tensor_meta.shape, mat.mesh.shape,
                                             mat.placements)

    return keeps


@single_dim_rule("aten::addmv", family=FAMILY, layouts=_addmv_layouts)
def addmv_rule(op, args, kwargs):
    """A broadcast bias (shape [1] or []) is added to every row: it stays whole where the rows shard, and
    `layouts` drops the layouts that leave a rank an empty piece of the matrix (see
    addmv_pieces_keep_their_shape). torch's decomposition shards those rows too."""
    bias, mat, vec = args[:3]
    return factor_strategies("m,mk,k->m", [bias, mat, vec], additive=[0])


@single_dim_rule("aten::addr", family=FAMILY)
def addr_rule(op, args, kwargs):
    bias, left, right = args[:3]
    return factor_strategies("mn,m,n->mn", [bias, left, right], additive=[0])


@single_dim_rule("aten::vdot", family=FAMILY)
def vdot_rule(op, args, kwargs):
    return factor_strategies("k,k->", list(args[:2]))


@single_dim_rule("aten::addbmm", family=FAMILY)
def addbmm_rule(op, args, kwargs):
    bias, batch1, batch2 = args[:3]
    return factor_strategies("mn,bmk,bkn->mn", [bias, batch1, batch2], additive=[0])


@single_dim_rule("aten::_int_mm", family=FAMILY)
def int_mm_rule(op, args, kwargs):
    """int8 x int8 -> int32: sums are exact, averages are not."""
    return factor_strategies("mk,kn->mn", list(args[:2]), linear_reductions=("sum",))


@single_dim_rule("aten::_addmm_activation", family=FAMILY)
def addmm_activation_rule(op, args, kwargs):
    """relu/gelu after the product: only factors that reach the output may be sharded, nothing Partial."""
    bias, left, right = args[:3]
    return factor_strategies(
        "mn,mk,kn->mn", [bias, left, right], additive=[0], contracted_reductions=(), linear_reductions=()
    )


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@single_dim_rule("aten::_trilinear", family=FAMILY, schema_info=RuntimeSchemaInfo(3))
def trilinear_rule(op, args, kwargs):
    """nn.functional.bilinear's kernel: three operands unsqueezed to one rank, multiplied, summed over sumdim."""
    i1, i2, i3, expand1, expand2, expand3, sumdim = args[:7]
    rank = len(i1.shape) + len(expand1)
    operands = [
        "".join(_LETTERS[d] for d in range(rank) if d not in expand) for expand in (expand1, expand2, expand3)
    ]
    output = "".join(_LETTERS[d] for d in range(rank) if d not in sumdim)
    return factor_strategies(f"{','.join(operands)}->{output}", [i1, i2, i3])
