"""Elementwise ops torch 2.13 cannot shard (activation backwards included), glu, and reflection/replication pads.

An elementwise result at an index depends on the operands at that index only, so any output dim may be
sharded, the operands that have it (unbroadcast) sharded alike and the rest replicated: the factor signature
"abc,bc->abc" with nothing contracted.
"""

from __future__ import annotations

import string

from dtensor_ext._compat import Partial, Replicate, RuntimeSchemaInfo, ShardingPlaceholder, TensorMeta
from dtensor_ext.registry import single_dim_rule
from dtensor_ext.rules.factors import factor_strategies

FAMILY = "pointwise"


def _broadcast_signature(metas) -> str:
    """'abc,bc->abc' for operands broadcast against each other (each aligned to the output from the right)."""
    ndim = max(len(m.shape) for m in metas)
    letters = string.ascii_lowercase[:ndim]
    return ",".join(letters[ndim - len(m.shape) :] for m in metas) + "->" + letters


def elementwise_rows(metas) -> list[list]:
    """Shard any output dim in every operand that holds it unbroadcast; nothing Partial."""
    return factor_strategies(_broadcast_signature(metas), metas, contracted_reductions=(), linear_reductions=())


@single_dim_rule("aten::complex", family=FAMILY)
def complex_rule(op, args, kwargs):
    """real + i*imag is linear in the pair: both Partial(sum) gives a Partial(sum) result; one alone does not.

    (Partial(avg) is as linear, but the checker cannot average complex pieces, so it stays unproven and out.)
    """
    real, imag = args[:2]
    return elementwise_rows([real, imag]) + [[Partial("sum")] * 3]


@single_dim_rule("aten::polar", family=FAMILY)
def polar_rule(op, args, kwargs):
    """abs * (cos(angle) + i*sin(angle)) is linear in abs: a Partial(sum) abs with the angle replicated gives a
    Partial(sum) result, with no collective. torch 2.15 alone reaches that layout through polar's decomposition
    (a product with a replicated factor); without it the package all-reduced abs first."""
    return elementwise_rows(list(args[:2])) + [[Partial("sum"), Partial("sum"), Replicate()]]


@single_dim_rule(["aten::isin.Tensor_Tensor", "aten::isin.Tensor_Scalar"], family=FAMILY,
                 schema_info=RuntimeSchemaInfo(1, static_kwargkey=["invert"]))
def isin_rule(op, args, kwargs):
    """Each element is looked up on its own: shard the elements anywhere, keep the test set whole. Or split the
    test set: each rank's answer is "in my part", and an element is in the whole set when it is in any part,
    Partial(max) of the booleans (with invert, in none: Partial(min); an empty part answers False, or True
    inverted, which changes neither). torch alone reaches that layout through isin's decomposition (eq, then
    any over the test set)."""
    elements = args[0]
    if not isinstance(args[1], TensorMeta):
        return [[ShardingPlaceholder(d), ShardingPlaceholder(d)] for d in range(len(elements.shape))]
    rows = [[ShardingPlaceholder(d), ShardingPlaceholder(d), Replicate()] for d in range(len(elements.shape))]
    split_tests = Partial("min" if kwargs.get("invert", False) else "max")
    return rows + [[split_tests, Replicate(), ShardingPlaceholder(d)] for d in range(len(args[1].shape))]


@single_dim_rule("aten::renorm", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def renorm_rule(op, args, kwargs):
    """renorm(x, p, dim, maxnorm) rescales each slice x.select(dim, i) by its own norm: only `dim` splits slices
    apart without cutting one."""
    self, dim = args[0], args[2]
    if len(self.shape) == 0:
        return []
    d = dim % len(self.shape)
    return [[ShardingPlaceholder(d), ShardingPlaceholder(d)]]


# Pads copy values around (reflection mirrors, replication repeats the edge), so every Partial kind passes
# through the forward; the backward sums the gradients of the copies, so only sum and avg pass through it.
# Of the dims a pad leaves alone only the batch dim may be sharded: see _batch_dims.
_PADS = {
    f"aten::{kind}_pad{n}d": n for kind in ("reflection", "replication") for n in (1, 2, 3)
}


def _batch_dims(ndim: int, padding) -> list[int]:
    """The batch dim, where the input has one (the pad kernels accept an empty batch but no other empty dim, and
    uneven sharding can leave a rank with an empty shard of any dim)."""
    return [0] if ndim == len(padding) // 2 + 2 else []


@single_dim_rule(list(_PADS), family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def pad_rule(op, args, kwargs):
    self, padding = args[0], args[1]
    rows = [[ShardingPlaceholder(d)] * 2 for d in _batch_dims(len(self.shape), padding)]
    return rows + [[Partial(r)] * 2 for r in ("sum", "avg", "max", "min")]


@single_dim_rule([f"{name}_backward" for name in _PADS], family=FAMILY, schema_info=RuntimeSchemaInfo(2))
def pad_backward_rule(op, args, kwargs):
    """(grad_output, self, padding) -> grad_input; `self` only lends its shape, so it follows grad_input."""
    self, padding = args[1], args[2]
    rows = [[ShardingPlaceholder(d)] * 3 for d in _batch_dims(len(self.shape), padding)]
    return rows + [[Partial(r), Partial(r), Replicate()] for r in ("sum", "avg")]


def _tensors(args) -> list:
    return [a for a in args if isinstance(a, TensorMeta)]


# Backward of an elementwise activation: grad_input = grad_output * f'(x), elementwise in every tensor argument and
# linear in grad_output (always the first), so a Partial sum/avg grad_output with the rest replicated stays Partial.
@single_dim_rule(
    [
        "aten::hardtanh_backward",
        "aten::elu_backward",
        "aten::leaky_relu_backward",
        "aten::softplus_backward",
        "aten::hardswish_backward",
        "aten::hardsigmoid_backward",
    ],
    family=FAMILY,
    schema_info=RuntimeSchemaInfo(1),
)
def activation_backward_rule(op, args, kwargs):
    tensors = _tensors(args)
    rows = elementwise_rows(tensors)
    return rows + [[Partial(r), Partial(r), *([Replicate()] * (len(tensors) - 1))] for r in ("sum", "avg")]


@single_dim_rule(["aten::floor_divide", "aten::floor_divide.Scalar"], family=FAMILY)
def floor_divide_rule(op, args, kwargs):
    return elementwise_rows(_tensors(args))


@single_dim_rule("aten::masked_fill.Tensor", family=FAMILY)
def masked_fill_rule(op, args, kwargs):
    """(self, mask, value): self and the mask (broadcast to self) elementwise, the 0-d fill value whole."""
    self, mask = args[0], args[1]
    return [[*row, Replicate()] for row in elementwise_rows([self, mask])]


@single_dim_rule(["aten::fill.Tensor", "aten::fill_.Tensor"], family=FAMILY)
def fill_rule(op, args, kwargs):
    """(self, value): every element becomes the 0-d value, so the result is sharded wherever self is, and a
    Partial value gives a Partial result (each rank writes its part). ``x[:, :2] = 0.0`` on a DTensor runs this."""
    self = args[0]
    rows = [[ShardingPlaceholder(d), ShardingPlaceholder(d), Replicate()] for d in range(len(self.shape))]
    return rows + [[Partial(r)] * 3 for r in ("sum", "avg")]


@single_dim_rule("aten::glu", family=FAMILY, schema_info=RuntimeSchemaInfo(1))
def glu_rule(op, args, kwargs):
    """glu halves `dim` (a * sigmoid(b) of its two halves): every other dim is elementwise."""
    self = args[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", -1)) % len(self.shape)
    return [[ShardingPlaceholder(d)] * 2 for d in range(len(self.shape)) if d != dim]


@single_dim_rule("aten::glu_backward", family=FAMILY, schema_info=RuntimeSchemaInfo(2))
def glu_backward_rule(op, args, kwargs):
    """(grad_output, self, dim) -> grad_input: elementwise off `dim`, linear in grad_output."""
    self, dim = args[1], args[2] % len(args[1].shape)
    rows = [[ShardingPlaceholder(d)] * 3 for d in range(len(self.shape)) if d != dim]
    return rows + [[Partial(r), Partial(r), Replicate()] for r in ("sum", "avg")]


# Elementwise losses: where the `reduction` argument sits, forward and backward (absent means the default, mean).
_LOSS_REDUCTION_ARG = {
    "aten::mse_loss": 2,
    "aten::huber_loss": 2,
    "aten::smooth_l1_loss": 2,
    "aten::soft_margin_loss": 2,
    "aten::binary_cross_entropy": 3,
    "aten::binary_cross_entropy_with_logits": 4,
}
_LOSS_BACKWARD_REDUCTION_ARG = {
    "aten::mse_loss_backward": 3,
    "aten::huber_loss_backward": 3,
    "aten::smooth_l1_loss_backward": 3,
    "aten::soft_margin_loss_backward": 3,
    "aten::binary_cross_entropy_backward": 4,
}
NO_REDUCTION, MEAN, SUM = 0, 1, 2


def _reduction(op, args, kwargs, table) -> int:
    position = table[op.name()]
    return args[position] if len(args) > position else kwargs.get("reduction", MEAN)


@single_dim_rule(list(_LOSS_REDUCTION_ARG), family=FAMILY, schema_info=RuntimeSchemaInfo(2))
def loss_rule(op, args, kwargs):
    """An elementwise loss, then nothing / mean / sum. Unreduced it is elementwise; summed, every shard's sum is a
    piece of the total (Partial(sum)); a mean is left whole, since uneven shards make a mean of means wrong."""
    reduction = _reduction(op, args, kwargs, _LOSS_REDUCTION_ARG)
    rows = elementwise_rows(_tensors(args))
    if reduction == NO_REDUCTION:
        return rows
    if reduction == SUM:
        return [[Partial("sum"), *row[1:]] for row in rows]
    return []


@single_dim_rule(list(_LOSS_BACKWARD_REDUCTION_ARG), family=FAMILY, schema_info=RuntimeSchemaInfo(3))
def loss_backward_rule(op, args, kwargs):
    """(grad_output, self, target, ...) -> grad_input, linear in grad_output. With a mean the gradient divides by
    the global element count, which a shard does not know: only the Partial rows remain."""
    reduction = _reduction(op, args, kwargs, _LOSS_BACKWARD_REDUCTION_ARG)
    tensors = _tensors(args)
    partial_rows = [[Partial(r), Partial(r), *([Replicate()] * (len(tensors) - 1))] for r in ("sum", "avg")]
    if reduction == MEAN:
        return partial_rows
    return elementwise_rows(tensors) + partial_rows


@single_dim_rule("aten::_prelu_kernel", family=FAMILY)
def prelu_rule(op, args, kwargs):
    """F.prelu's kernel: x where positive, weight * x elsewhere; the weight comes broadcast to x's rank."""
    return elementwise_rows(list(args[:2]))


@single_dim_rule("aten::_prelu_kernel_backward", family=FAMILY)
def prelu_backward_rule(op, args, kwargs):
    """(grad_output, self, weight) -> (grad_input, grad_weight), both at self's full shape (autograd sums
    grad_weight down afterwards): elementwise, and linear in grad_output."""
    rows = [[row[0], *row] for row in elementwise_rows(list(args[:3]))]
    return rows + [[Partial(r), Partial(r), Partial(r), Replicate(), Replicate()] for r in ("sum", "avg")]


# Per-sample losses over class scores [N, C] (or one sample [C]): each sample's loss reads its whole row, so only
# the batch dim N shards; where the `reduction` argument sits, forward and backward.
_SAMPLE_LOSS_REDUCTION_ARG = {"aten::multi_margin_loss": 5, "aten::multilabel_margin_loss_forward": 2}
_SAMPLE_LOSS_BACKWARD_REDUCTION_ARG = {
    "aten::multi_margin_loss_backward": 6,
    "aten::multilabel_margin_loss_backward": 3,
}


@single_dim_rule(list(_SAMPLE_LOSS_REDUCTION_ARG), family=FAMILY, schema_info=RuntimeSchemaInfo(2),
                 allow_uneven_sharding=False)
def sample_loss_rule(op, args, kwargs):
    """(self, target, ...) -> loss per sample [N] (plus multilabel's is_target [N, C]): unreduced, the batch dim
    shards throughout; summed, each shard's sum is a piece (Partial(sum)); a mean is left whole.

    Even shards only: torch 2.13's CPU kernels return an uninitialised value when summing an empty batch, and
    uneven shards can be empty."""
    reduction = _reduction(op, args, kwargs, _SAMPLE_LOSS_REDUCTION_ARG)
    self = args[0]
    if len(self.shape) < 2 or reduction == MEAN:
        return []
    weight = [Replicate()] * (len(_tensors(args)) - 2)  # multi_margin_loss's class weight [C]
    inputs = [ShardingPlaceholder(0), ShardingPlaceholder(0), *weight]
    loss = ShardingPlaceholder(0) if reduction == NO_REDUCTION else Partial("sum")
    is_target = [ShardingPlaceholder(0)] if op.name() == "aten::multilabel_margin_loss_forward" else []
    return [[loss, *is_target, *inputs]]


@single_dim_rule(list(_SAMPLE_LOSS_BACKWARD_REDUCTION_ARG), family=FAMILY, schema_info=RuntimeSchemaInfo(3))
def sample_loss_backward_rule(op, args, kwargs):
    """(grad_output, self, target, ...) -> grad_input [N, C], linear in grad_output. The batch dim shards unless
    the loss was a mean (its gradient divides by the global N); a summed loss's grad_output is a replicated
    scalar."""
    reduction = _reduction(op, args, kwargs, _SAMPLE_LOSS_BACKWARD_REDUCTION_ARG)
    tensors = _tensors(args)
    rest = [Replicate()] * (len(tensors) - 1)
    rows = [[Partial(r), Partial(r), *rest] for r in ("sum", "avg")]
    if len(tensors[1].shape) < 2 or reduction == MEAN:
        return rows
    grad = ShardingPlaceholder(0) if reduction == NO_REDUCTION else Replicate()
    extra = [ShardingPlaceholder(0) if op.name() == "aten::multilabel_margin_loss_backward" else Replicate()
             for _ in tensors[3:]]  # multilabel's is_target [N, C]; multi_margin's weight [C]
    return rows + [[ShardingPlaceholder(0), grad, ShardingPlaceholder(0), ShardingPlaceholder(0), *extra]]


@single_dim_rule("aten::_conj_physical", family=FAMILY)
def conj_physical_rule(op, args, kwargs):
    """The materialised complex conjugate (fft.ihfft2/ihfftn call it): elementwise, and it commutes with sums
    (not offered for avg: a complex Partial(avg) cannot be reduced on CPU)."""
    return [[row[0], row[0]] for row in elementwise_rows([args[0]])] + [[Partial("sum"), Partial("sum")]]
