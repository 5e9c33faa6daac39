"""Which ops are token-local: each token's output depends only on that token's inputs.

A rule looks at one FX node whose inputs ``dims`` maps to their token dim (the inputs that hold a token shard)
and answers either ``None`` (the op needs every token, or the other inputs would need slicing) or a
:class:`Local` saying where the token dim of the output is and, for ops with shape arguments, the arguments
that make the op work on the shard. The table is open: register your own ops (a fused add+norm custom op is
``rowwise(trailing=1)``) with :func:`register_token_local`; ops before which an all_gather may be placed (the
next column-parallel matmul) with :func:`register_gather_point`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

__all__ = [
    "GATHER_POINTS",
    "POSITIONS",
    "RANDOM_DRAWS",
    "SAME_ON_EVERY_RANK",
    "TOKEN_LOCAL",
    "Local",
    "TokenRule",
    "elementwise",
    "reduction",
    "register_gather_point",
    "register_token_local",
    "rowwise",
]

aten = torch.ops.aten


@dataclass(frozen=True)
class Local:
    """The op runs on the token shard. ``role`` feeds the match report; "view" roles do no arithmetic."""

    dim: int
    args: tuple | None = None
    role: str = "elementwise"


TokenRule = Callable[[Node, Mapping[Node, int], int], "Local | None"]


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def _tensor_inputs(node: Node) -> list[Node]:
    return [n for n in node.all_input_nodes if isinstance(_val(n), torch.Tensor)]


def _uniform_over_tokens(node: Node, dim: int, out_ndim: int) -> bool:
    """Whether ``node`` broadcasts along the output's token dim (size 1 there, or no such dim)."""
    val = _val(node)
    if not isinstance(val, torch.Tensor):
        return True
    pos = dim - (out_ndim - val.ndim)
    return pos < 0 or val.shape[pos] == 1


def elementwise(role: str = "elementwise") -> TokenRule:
    """Broadcasting pointwise ops: unsharded operands must not carry the token dim (size 1 or absent there)."""

    def rule(node: Node, dims: Mapping[Node, int], group_size: int) -> Local | None:
        out = _val(node)
        if not isinstance(out, torch.Tensor):
            return None
        inputs = _tensor_inputs(node)
        sharded = {out.ndim - _val(i).ndim + dims[i] for i in inputs if i in dims}
        if len(sharded) != 1:
            return None
        (dim,) = sharded
        swap = {}
        for other in (i for i in inputs if i not in dims):
            if not _uniform_over_tokens(other, dim, out.ndim):
                source = other.args[0] if other.op == "call_function" and other.target == aten.expand.default else None
                if not isinstance(source, Node) or not _uniform_over_tokens(source, dim, out.ndim):
                    return None
                swap[other] = source  # x.expand(full shape) * shard == x * shard: broadcasting does the expand
        residual_add = role == "elementwise" and node.target in _ADDS and sum(i in dims for i in inputs) > 1
        args = torch.fx.node.map_arg(node.args, lambda n: swap.get(n, n)) if swap else None
        return Local(dim, args=args, role="add" if residual_add else role)

    return rule


def rowwise(normalized_arg: int | None = None, trailing: int = 1, role: str = "norm") -> TokenRule:
    """Ops that mix only the last k dims of each row (norms, fused add+norm). k is ``len(args[normalized_arg])``
    when given (``normalized_shape``), else ``trailing``. Unsharded tensor inputs (weights) may have at most k
    dims; every tensor output keeps the token dim. Two or more sharded inputs make it a fused add+norm."""

    def rule(node: Node, dims: Mapping[Node, int], group_size: int) -> Local | None:
        k = len(node.args[normalized_arg]) if normalized_arg is not None else trailing
        token_dims = set()
        for inp in _tensor_inputs(node):
            ndim = _val(inp).ndim
            if inp in dims:
                if dims[inp] >= ndim - k:
                    return None
                token_dims.add(dims[inp])
            elif ndim > k:
                return None
        if len(token_dims) != 1:
            return None
        fused = sum(i in dims for i in _tensor_inputs(node)) > 1
        return Local(token_dims.pop(), role="fused_add_norm" if fused else role)

    return rule


def reduction(dim_arg: int = 1, keepdim_arg: int = 2) -> TokenRule:
    """Reductions over dims other than the token dim (the mean of a decomposed RMSNorm)."""

    def rule(node: Node, dims: Mapping[Node, int], group_size: int) -> Local | None:
        (source,) = [i for i in _tensor_inputs(node) if i in dims] or [None]
        if source is None or len(_tensor_inputs(node)) != 1:
            return None
        ndim = _val(source).ndim
        reduced = node.args[dim_arg] if len(node.args) > dim_arg else node.kwargs.get("dim")
        if reduced is None:
            return None
        reduced = {r % ndim for r in ([reduced] if isinstance(reduced, int) else reduced)}
        dim = dims[source]
        if dim in reduced or not reduced:
            return None
        keepdim = node.args[keepdim_arg] if len(node.args) > keepdim_arg else node.kwargs.get("keepdim", False)
        return Local(dim if keepdim else dim - sum(r < dim for r in reduced), role="reduction")

    return rule


def _softmax(node: Node, dims: Mapping[Node, int], group_size: int) -> Local | None:
    source, dim = node.args[0], node.args[1]
    if source not in dims or dim % _val(source).ndim == dims[source]:
        return None
    return Local(dims[source], role="elementwise")


def _view(node: Node, dims: Mapping[Node, int], group_size: int) -> Local | None:
    """A reshape keeps tokens local when the dims before the token dim hold the same elements in and out, and the
    new dim there divides by the group: rank r's contiguous block per leading index is then the same memory."""
    source = node.args[0]
    if source not in dims:
        return None
    before, after = list(_val(source).shape), list(_val(node).shape)
    if not all(isinstance(s, int) for s in before + after):
        return None
    dim = dims[source]
    lead = math.prod(before[:dim])
    for new_dim in range(len(after)):
        if math.prod(after[:new_dim]) == lead and after[new_dim] >= group_size and after[new_dim] % group_size == 0:
            local = after[:new_dim] + [after[new_dim] // group_size] + after[new_dim + 1 :]
            return Local(new_dim, args=(source, local, *node.args[2:]), role="view")
        if math.prod(after[:new_dim]) > lead:
            break
    return None


def _permute(node: Node, dims: Mapping[Node, int], group_size: int) -> Local | None:
    source, order = node.args[0], node.args[1]
    if source not in dims:
        return None
    ndim = _val(source).ndim
    return Local([o % ndim for o in order].index(dims[source]), role="view")


def _transpose(node: Node, dims: Mapping[Node, int], group_size: int) -> Local | None:
    source = node.args[0]
    if source not in dims:
        return None
    ndim = _val(source).ndim
    a, b = (d % ndim for d in node.args[1:3])
    dim = dims[source]
    return Local(b if dim == a else a if dim == b else dim, role="view")


def _t(node: Node, dims: Mapping[Node, int], group_size: int) -> Local | None:
    source = node.args[0]
    if source not in dims:
        return None
    return Local(_val(source).ndim - 1 - dims[source], role="view")


def _unsqueeze(node: Node, dims: Mapping[Node, int], group_size: int) -> Local | None:
    source, where = node.args[0], node.args[1] % _val(node).ndim
    if source not in dims:
        return None
    return Local(dims[source] + (where <= dims[source]), role="view")


def _expand(node: Node, dims: Mapping[Node, int], group_size: int) -> Local | None:
    """An expand that keeps the token dim's size (the mean's [T, 1] -> [T, H] in an RMSNorm backward)."""
    source, size = node.args[0], list(node.args[1])
    if source not in dims:
        return None
    dim = dims[source] + len(size) - _val(source).ndim
    if _val(source).shape[dims[source]] != _val(node).shape[dim]:
        return None
    size[dim] = -1
    return Local(dim, args=(source, size, *node.args[2:]), role="view")


def _same_layout(node: Node, dims: Mapping[Node, int], group_size: int) -> Local | None:
    source = node.args[0]
    return Local(dims[source], role="view") if source in dims else None


_ADDS = {aten.add.Tensor, aten.add_.Tensor}

_ELEMENTWISE = [
    aten.add.Tensor, aten.add.Scalar, aten.add_.Tensor, aten.add_.Scalar,
    aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor, aten.mul_.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.div_.Tensor, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
    aten.rsqrt.default, aten.sqrt.default, aten.neg.default, aten.exp.default, aten.log.default,
    aten.tanh.default, aten.sigmoid.default, aten.silu.default, aten.gelu.default, aten.relu.default,
    aten.abs.default, aten.reciprocal.default, aten.where.self, aten.maximum.default, aten.minimum.default,
    aten.clamp.default, aten.masked_fill.Scalar,
]  # fmt: skip
_SAME_LAYOUT = [
    aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
    torch.ops.prims.convert_element_type.default, operator.getitem,
]  # fmt: skip

TOKEN_LOCAL: dict[Any, TokenRule] = {
    **{op: elementwise() for op in _ELEMENTWISE},
    **{op: _same_layout for op in _SAME_LAYOUT},
    aten.native_layer_norm.default: rowwise(normalized_arg=1),
    aten.rms_norm.default: rowwise(normalized_arg=1),
    aten._fused_rms_norm.default: rowwise(normalized_arg=1),
    aten.mean.dim: reduction(),
    aten.sum.dim_IntList: reduction(),
    aten.amax.default: reduction(),
    aten.amin.default: reduction(),
    aten.var.correction: reduction(),
    aten.var_mean.correction: reduction(),
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _softmax,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.reshape.default: _view,
    aten.permute.default: _permute,
    aten.transpose.int: _transpose,
    aten.t.default: _t,
    aten.unsqueeze.default: _unsqueeze,
    aten.expand.default: _expand,
}

# Consumers that need every token and before which gathering is the intended boundary (the next
# column-parallel matmul); views that move tokens across ranks count too. Any other non-token-local consumer
# (a softmax or sum over tokens) makes the pass leave the all_reduces feeding it alone.
GATHER_POINTS: set[Any] = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.matmul.default,
    aten.linear.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.expand.default,
}  # fmt: skip


# Ops whose result is the same on every rank when their tensor inputs are: a full-token operand built from graph
# inputs with these alone (a learned position embedding ``w[arange(S)]``, a replicated mask) is sliced to this
# rank's tokens where it meets a shard, instead of gathering the shard. Contractions (a matmul with a sharded weight
# gives per-rank partial sums), collectives and graph constants (``get_attr``) are not in it, and an op given a
# number (``ids - offset``, ``clamp``) counts only on a random draw: a traced graph bakes per-rank numbers (a
# vocab-parallel embedding's offset) in as constants, the dropout threshold and scale are the same on every rank.
SAME_ON_EVERY_RANK: set[Any] = {
    *_ELEMENTWISE, *_SAME_LAYOUT,
    aten.gt.Scalar, aten.gt.Tensor, aten.lt.Scalar, aten.lt.Tensor, aten.ge.Scalar, aten.ge.Tensor,
    aten.le.Scalar, aten.le.Tensor, aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor,
    aten.logical_and.default, aten.logical_or.default, aten.logical_not.default, aten.bitwise_and.Tensor,
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default,
    aten.index.Tensor, aten.embedding.default, aten.index_select.default,
}  # fmt: skip
# Factories: positions counted from 0 (``arange(S)``), and random draws (tensor parallelism draws a replicated
# activation's dropout mask with the same generator state on every rank).
POSITIONS = {torch.ops.prims.iota.default, aten.arange.default, aten.arange.start, aten.arange.start_step}
RANDOM_DRAWS = {aten.rand.default}


def _check_op(op: Any, what: str) -> None:
    if not callable(op):
        raise TypeError(f"{what}: op {op!r} is not callable; expected an OpOverload such as torch.ops.aten.add.Tensor")


def register_token_local(op: Any, rule: TokenRule) -> None:
    """Declare ``op`` token-local; ``rule`` is one of :func:`elementwise`, :func:`rowwise`, :func:`reduction`
    or your own ``rule(node, dims, group_size) -> Local | None``."""
    _check_op(op, "register_token_local")
    if not callable(rule):
        raise TypeError(f"register_token_local({op}): rule {rule!r} is not callable; expected e.g. rowwise()")
    TOKEN_LOCAL[op] = rule


def register_gather_point(op: Any) -> None:
    """Declare that ``op`` needs every token and that gathering right before it is the plan."""
    _check_op(op, "register_gather_point")
    GATHER_POINTS.add(op)
