"""Grouped GEMMs of mixture-of-experts layers.

``_grouped_mm(a, b, offs)`` multiplies groups of rows (or columns) by one expert's weight each. Name the dims:
g experts, m tokens, k the contracted hidden dim, n the output dim. One letter layout per operand ranks:

=========  ==========  ==========  ==========  ===============================
a x b      a           b           out         offs cuts the group along
=========  ==========  ==========  ==========  ===============================
2-D x 3-D  m k         g k n       m n         m (token rows per expert)
3-D x 3-D  g m k       g k n       g m n       (none: one batch entry each)
3-D x 2-D  g m k       k n         m n         n
2-D x 2-D  m k         k n         g m n       k
=========  ==========  ==========  ==========  ===============================

A factor may be sharded everywhere it appears (tensor parallel on n, expert parallel on g in 3-D x 3-D), a
contracted k gives a Partial(sum) output, except the factor offs cuts into groups (offs holds global offsets)
and g where an operand lacks it (groups of rows are not a batch dim). Scaled variants carry row-wise scales that
index the same factors as their operand (scale_a: m, and g where a has it; scale_b: n, and g where b has it), so
they follow those factors; they are fp8, so no operand goes Partial there.
"""

from __future__ import annotations

from dtensor_ext._compat import Partial, Replicate, RuntimeSchemaInfo
from dtensor_ext._compat import ShardingPlaceholder as S
from dtensor_ext.registry import single_dim_rule
from dtensor_ext.rules.indexing import scatter_rows

FAMILY = "moe"

R = Replicate

# (a rank, b rank) -> (a, b, out, the factor offs cuts)
LAYOUTS = {
    (2, 3): ("mk", "gkn", "mn", "m"),
    (3, 3): ("gmk", "gkn", "gmn", None),
    (3, 2): ("gmk", "kn", "mn", "n"),
    (2, 2): ("mk", "kn", "gmn", "k"),
}
# row-wise scales: the factors of their operand that they index
SCALE_FACTORS = {"a": "gm", "b": "gn"}


def _shardable(factor: str, a: str, b: str, cut: str | None) -> bool:
    return factor != cut and (factor != "g" or (factor in a and factor in b))


def grouped_mm_rows(a_meta, b_meta, scales=(), linear=("sum", "avg")) -> list[list]:
    """Rows [out, a, b, *scales] for the layout of a and b; `scales` lists which operand ("a"/"b") each scale
    belongs to, in argument order. linear: Partial kinds passing through a or b alone (none for fp8 operands)."""
    layout = LAYOUTS.get((len(a_meta.shape), len(b_meta.shape)))
    if layout is None:
        return []
    a, b, out, cut = layout
    scale_letters = [
        "".join(f for f in (a if owner == "a" else b) if f in SCALE_FACTORS[owner]) for owner in scales
    ]
    rows = []
    for factor in dict.fromkeys(a + b):
        if not _shardable(factor, a, b, cut):
            continue
        out_place = S(out.index(factor)) if factor in out else Partial("sum")
        operands = [S(letters.index(factor)) if factor in letters else R() for letters in (a, b, *scale_letters)]
        rows.append([out_place, *operands])
    for k in linear:
        rows.append([Partial(k), Partial(k), R(), *(R() for _ in scales)])
        rows.append([Partial(k), R(), Partial(k), *(R() for _ in scales)])
    return rows


def _with_offsets(rows, offs):
    """offs (global group ends) stays whole in every row."""
    return [[*row, R()] for row in rows] if offs is not None else rows


@single_dim_rule("aten::_grouped_mm", family=FAMILY)
def grouped_mm_rule(op, args, kwargs):
    """(a, b, offs?, bias?, out_dtype?); torch 2.13 has its own strategy, so this rule stands in where it lacks one
    and is the proven base of the scaled variants."""
    a, b = args[:2]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    if bias is not None:  # the kernel rejects a bias
        return []
    return _with_offsets(grouped_mm_rows(a, b), offs)


@single_dim_rule("aten::_scaled_grouped_mm", family=FAMILY)
def scaled_grouped_mm_rule(op, args, kwargs):
    """(a, b, scale_a, scale_b, offs?, bias?, scale_result?, ...): fp8 row-wise scaled _grouped_mm."""
    a, b, scale_a, scale_b = args[:4]
    offs, bias, scale_result = (args[i] if len(args) > i else kwargs.get(name)
                                for i, name in ((4, "offs"), (5, "bias"), (6, "scale_result")))
    if bias is not None or scale_result is not None or _blocked_scales(a, b, scale_a, scale_b):
        return []
    return _with_offsets(grouped_mm_rows(a, b, scales=("a", "b"), linear=()), offs)


@single_dim_rule("aten::_scaled_grouped_mm_v2", family=FAMILY, schema_info=RuntimeSchemaInfo(needs_pytree=True))
def scaled_grouped_mm_v2_rule(op, args, kwargs):
    """(a, b, [scale_a], recipe_a, swizzle_a, [scale_b], recipe_b, swizzle_b, offs?, bias?, ...): the same rows
    when each side has exactly one row-wise scale; block-scaled recipes (MX, NV) are not claimed."""
    a, b, scales_a, _, _, scales_b = args[:6]
    offs = args[8] if len(args) > 8 else kwargs.get("offs")
    bias = args[9] if len(args) > 9 else kwargs.get("bias")
    contraction_dim = args[11] if len(args) > 11 else kwargs.get("contraction_dim", [])
    if bias is not None or contraction_dim or len(scales_a) != 1 or len(scales_b) != 1:
        return []
    if _blocked_scales(a, b, scales_a[0], scales_b[0]):
        return []
    rows = grouped_mm_rows(a, b, scales=("a", "b"), linear=())
    return _with_offsets(rows, offs)


def _blocked_scales(a, b, scale_a, scale_b) -> bool:
    """Whether the scales are not row-wise (one per row of a / column of b, per group where 3-D): MX block
    scales are swizzled tiles that no sharding of a or b maps onto."""
    def rowwise(scale, mat, factor_dim):
        if len(mat.shape) == 2:
            return tuple(scale.shape) == (mat.shape[factor_dim],)
        return tuple(scale.shape) == (mat.shape[0], mat.shape[1 + factor_dim])

    return not (rowwise(scale_a, a, 0) and rowwise(scale_b, b, 1))


# Routing: torch 2.13 already shards topk and sort along a dim other than the sharded token dim, and histc of
# sharded tokens (with fixed min/max) to Partial(sum); bincount's output size depends on the data. What it lacks
# is the combine: scatter_add with index and src split along the scattered (token) dim, where each rank adds its
# own tokens' contributions and the output is Partial(sum).
@single_dim_rule("aten::scatter_add", family=FAMILY, schema_info=RuntimeSchemaInfo(1), superset_of_torch=True)
def scatter_add_rule(op, args, kwargs):
    """(self, dim, index, src): the rows of scatter_reduce(sum, include_self), which cover torch's own rule
    wherever src lines up with index; install(upgrade=["aten::scatter_add"]) puts it in place of torch's."""
    self, dim, index, src = args[:4]
    return scatter_rows(self, dim, index, src, "sum", include_self=True)
