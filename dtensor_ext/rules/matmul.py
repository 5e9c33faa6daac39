"""Matmul-like ops torch 2.13 cannot shard: products of operands summed over shared factors.

Each rule is its factor signature; the generator (`rules/factors.py`) turns it into single-dim strategies.
"""

from __future__ import annotations

from dtensor_ext._compat import RuntimeSchemaInfo, is_placeholder
from dtensor_ext.registry import single_dim_rule
from dtensor_ext.rules.factors import factor_strategies

FAMILY = "matmul"


@single_dim_rule("aten::mv", family=FAMILY)
def mv_rule(op, args, kwargs):
    mat, vec = args[:2]
    return factor_strategies("mk,k->m", [mat, vec])


@single_dim_rule("aten::addmv", family=FAMILY)
def addmv_rule(op, args, kwargs):
    bias, mat, vec = args[:3]
    rows = factor_strategies("m,mk,k->m", [bias, mat, vec], additive=[0])
    if tuple(bias.shape) != (mat.shape[0],):
        # addmv returns a broadcast bias's shape when the matrix shard is empty (addmv(b[1], m[0,k], v) and
        # addmv(b[1], m[5,0], v[0]) both have shape [1]), and uneven shards can be empty: shard nothing then.
        rows = [r for r in rows if not any(is_placeholder(p) for p in r)]
    return rows


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
