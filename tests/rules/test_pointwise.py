"""Proofs for the pointwise family: complex, polar, isin, renorm, pads, activation backwards, glu, losses, PReLU,
margin losses."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_ext._compat import Partial
from dtensor_ext.rules import pointwise
from dtensor_ext.testing.checker import sample_tensor
from dtensor_ext.testing.mesh import simulated_mesh
from dtensor_ext.testing.strategies import shapes
from tests.rules.proof import PROVING_MESHES, assert_proven, assert_torch_validator_agrees

aten = torch.ops.aten


@st.composite
def broadcast_pairs(draw):
    """Two shapes that broadcast together: the second a suffix of the first with some dims set to 1."""
    shape = draw(shapes(min_dims=0, max_dims=3))
    keep = draw(st.integers(0, len(shape)))
    other = [1 if draw(st.booleans()) else s for s in shape[len(shape) - keep :]]
    return (shape, tuple(other)) if draw(st.booleans()) else (tuple(other), shape)


@PROVING_MESHES
@given(pair=broadcast_pairs())
def test_complex_and_polar_proven(mesh_shape, pair):
    a, b = sample_tensor(pair[0]), sample_tensor(pair[1], seed=1)
    assert_proven(aten.complex.default, [a, b], rule=pointwise.complex_rule, mesh_shape=mesh_shape)
    assert_proven(aten.polar.default, [a.abs(), b], rule=pointwise.polar_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=0, max_dims=3), test_shape=shapes(min_dims=0, max_dims=2), invert=st.booleans())
def test_isin_proven(mesh_shape, shape, test_shape, invert):
    elements = sample_tensor(shape, torch.int64, high=6)
    tested = sample_tensor(test_shape, torch.int64, seed=1, high=6)
    kwargs = {"invert": invert}
    assert_proven(aten.isin.Tensor_Tensor, [elements, tested], kwargs, rule=pointwise.isin_rule, mesh_shape=mesh_shape)
    assert_proven(aten.isin.Tensor_Scalar, [elements, 3], kwargs, rule=pointwise.isin_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=2, max_dims=3), data=st.data())
def test_renorm_proven(mesh_shape, shape, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    p = data.draw(st.sampled_from([1, 2, 3.5]))
    args = [sample_tensor(shape), p, dim, 0.7]
    assert_proven(aten.renorm.default, args, rule=pointwise.renorm_rule, mesh_shape=mesh_shape)


@st.composite
def pad_samples(draw):
    kind = draw(st.sampled_from(["reflection", "replication"]))
    padded = draw(st.integers(1, 3))
    batched = draw(st.booleans())
    channels = draw(st.integers(1, 3))
    batch = (draw(st.integers(1, 5)),) if batched else ()
    spatial = draw(st.lists(st.integers(2, 4), min_size=padded, max_size=padded))
    # reflection needs each pad below its dim's size; pads are listed last dim first
    limit = [s - 1 if kind == "reflection" else 3 for s in reversed(spatial)]
    padding = [draw(st.integers(0, limit[i // 2])) for i in range(2 * padded)]
    return kind, padded, (*batch, channels, *spatial), padding


@PROVING_MESHES
@given(sample=pad_samples())
def test_pads_and_their_backward_proven(mesh_shape, sample):
    kind, padded, shape, padding = sample
    forward = getattr(aten, f"{kind}_pad{padded}d").default
    backward = getattr(aten, f"{kind}_pad{padded}d_backward").default
    x = sample_tensor(shape)
    assert_proven(forward, [x, padding], rule=pointwise.pad_rule, mesh_shape=mesh_shape)
    grad = sample_tensor(forward(x, padding).shape, seed=1)
    assert_proven(backward, [grad, x, padding], rule=pointwise.pad_backward_rule, mesh_shape=mesh_shape)


ACTIVATION_BACKWARDS = {
    "hardtanh_backward": lambda g, x: [g, x, -0.5, 0.5],
    "elu_backward": lambda g, x: [g, 1.0, 1.0, 1.0, False, x],
    "leaky_relu_backward": lambda g, x: [g, x, 0.1, False],
    "softplus_backward": lambda g, x: [g, x, 1.0, 1.5],
    "hardswish_backward": lambda g, x: [g, x],
    "hardsigmoid_backward": lambda g, x: [g, x],
}


@PROVING_MESHES
@given(shape=shapes(min_dims=0, max_dims=3), name=st.sampled_from(sorted(ACTIVATION_BACKWARDS)))
def test_activation_backwards_proven(mesh_shape, shape, name):
    g, x = sample_tensor(shape, seed=1), sample_tensor(shape) * 4
    op = getattr(aten, name).default
    assert_proven(op, ACTIVATION_BACKWARDS[name](g, x), rule=pointwise.activation_backward_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(pair=broadcast_pairs())
def test_floor_divide_and_masked_fill_proven(mesh_shape, pair):
    x = sample_tensor(pair[0]) * 5
    divisor = sample_tensor(pair[1], seed=1).abs() + 0.5
    assert_proven(aten.floor_divide.default, [x, divisor], rule=pointwise.floor_divide_rule, mesh_shape=mesh_shape)
    assert_proven(aten.floor_divide.Scalar, [x, 0.7], rule=pointwise.floor_divide_rule, mesh_shape=mesh_shape)
    wide, narrow = sorted(pair, key=len, reverse=True)
    if torch.broadcast_shapes(wide, narrow) == torch.Size(wide):
        args = [sample_tensor(wide), sample_tensor(narrow, torch.bool, seed=2), torch.tensor(2.5)]
        assert_proven(aten.masked_fill.Tensor, args, rule=pointwise.masked_fill_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=0, max_dims=3))
def test_fill_with_a_tensor_value_proven(mesh_shape, shape):
    x = sample_tensor(shape)
    for op in (aten.fill.Tensor, aten.fill_.Tensor):
        assert_proven(op, [x, torch.tensor(2.5)], rule=pointwise.fill_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=1, max_dims=3), data=st.data())
def test_glu_and_backward_proven(mesh_shape, shape, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    full = list(shape)
    full[dim] *= 2
    x = sample_tensor(full)
    assert_proven(aten.glu.default, [x, dim], rule=pointwise.glu_rule, mesh_shape=mesh_shape)
    grad = sample_tensor(shape, seed=1)
    assert_proven(aten.glu_backward.default, [grad, x, dim], rule=pointwise.glu_backward_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=2, max_dims=3), per_channel=st.booleans())
def test_prelu_and_backward_proven(mesh_shape, shape, per_channel):
    """F.prelu hands its kernels the weight viewed as [1, C, 1, ...] (or [1] for one shared slope)."""
    x = sample_tensor(shape)
    weight_shape = [1, shape[1], *([1] * (len(shape) - 2))] if per_channel else [1]
    weight = sample_tensor(weight_shape, seed=1)
    assert_proven(aten._prelu_kernel.default, [x, weight], rule=pointwise.prelu_rule, mesh_shape=mesh_shape)
    args = [sample_tensor(shape, seed=2), x, weight]
    assert_proven(aten._prelu_kernel_backward.default, args, rule=pointwise.prelu_backward_rule, mesh_shape=mesh_shape)


LOSSES = {  # name: (forward args, backward args after grad_output), given input, target, reduction
    "mse_loss": (lambda x, y, r: [x, y, r], lambda x, y, r: [x, y, r]),
    "huber_loss": (lambda x, y, r: [x, y, r, 0.5], lambda x, y, r: [x, y, r, 0.5]),
    "smooth_l1_loss": (lambda x, y, r: [x, y, r, 0.5], lambda x, y, r: [x, y, r, 0.5]),
    "soft_margin_loss": (lambda x, y, r: [x, y.sign(), r], lambda x, y, r: [x, y.sign(), r]),
    "binary_cross_entropy": (
        lambda x, y, r: [x.sigmoid(), y.sigmoid(), y.abs(), r], lambda x, y, r: [x.sigmoid(), y.sigmoid(), y.abs(), r]
    ),
    "binary_cross_entropy_with_logits": (lambda x, y, r: [x, y.sigmoid(), y.abs(), y.abs(), r], None),
}


@PROVING_MESHES
@given(shape=shapes(min_dims=1, max_dims=3), name=st.sampled_from(sorted(LOSSES)), reduction=st.sampled_from([0, 1, 2]))
def test_losses_and_backward_proven(mesh_shape, shape, name, reduction):
    x, y = sample_tensor(shape), sample_tensor(shape, seed=1)
    forward_args, backward_args = LOSSES[name]
    assert_proven(getattr(aten, name).default, forward_args(x, y, reduction), rule=pointwise.loss_rule,
                  mesh_shape=mesh_shape)
    if backward_args is not None:
        grad = sample_tensor(shape if reduction == 0 else (), seed=2)
        assert_proven(getattr(aten, f"{name}_backward").default, [grad, *backward_args(x, y, reduction)],
                      rule=pointwise.loss_backward_rule, mesh_shape=mesh_shape)


def test_torch_validator_finds_no_incorrect_rule():
    for name in ("complex", "polar", "nn.functional.pad", "nn.functional.glu", "floor_divide",
                 "nn.functional.multilabel_margin_loss"):
        assert_torch_validator_agrees(name)
    # these OpInfo samples only reach combinations the validator counts as trivial: run for false positives only
    for name in ("renorm", "nn.functional.mse_loss", "nn.functional.binary_cross_entropy", "nn.functional.prelu",
                 "nn.functional.multi_margin_loss", "fill"):
        assert_torch_validator_agrees(name, exercised=False)


def test_end_to_end_batch_sharded_pad_and_complex(installed):
    """F.pad(mode="reflect") on a batch-sharded input stays sharded, as does complex() of two sharded halves."""
    x = sample_tensor((5, 3, 4, 6))
    re, im = sample_tensor((5, 4)), sample_tensor((4,), seed=1)
    with simulated_mesh((2, 2)) as mesh:
        dx = distribute_tensor(x, mesh, [Shard(0), Replicate()])
        padded = F.pad(dx, (1, 2, 2, 1), mode="reflect")
        pad_placements, pad_full = padded.placements, padded.full_tensor()
        z = torch.complex(distribute_tensor(re, mesh, [Shard(0), Shard(1)]), distribute_tensor(im, mesh, [Replicate(), Shard(0)]))
        z_placements, z_full = z.placements, z.full_tensor()
    assert pad_placements == (Shard(0), Replicate())
    torch.testing.assert_close(pad_full, F.pad(x, (1, 2, 2, 1), mode="reflect"))
    assert z_placements == (Shard(0), Shard(1))
    torch.testing.assert_close(z_full, torch.complex(re, im))


def test_polar_of_a_partial_abs_stays_partial_without_a_collective(installed):
    """polar is linear in abs: a Partial(sum) abs with a replicated angle gives a Partial(sum) result, where the rule
    without that row all-reduced abs (torch 2.15 alone reaches the Partial layout through the decomposition)."""
    from dtensor_ext.testing.mesh import place_dtensor
    from dtensor_ext.tools.comm_stats import CommStatsMode

    r, theta = sample_tensor((10, 5)).abs(), sample_tensor((), seed=1)
    with simulated_mesh((4,)) as mesh:
        dr, dtheta = place_dtensor(r, mesh, [Partial("sum")]), place_dtensor(theta, mesh, [Replicate()])
        with CommStatsMode() as comm:
            z = torch.polar(dr, dtheta)
        placements, full = z.placements, z.full_tensor()
    assert placements == (Partial("sum"),)
    assert sum(comm.stats.collectives.values()) == 0, comm.stats
    torch.testing.assert_close(full, torch.polar(r, theta))


def test_end_to_end_activation_backward_keeps_shards(installed):
    """Gradients through ELU and GLU of a sequence-sharded activation come back sharded, no all-gather."""
    x = sample_tensor((4, 6, 8))
    with simulated_mesh((2, 2)) as mesh:
        dx = distribute_tensor(x, mesh, [Shard(0), Shard(1)]).requires_grad_()
        y = F.glu(F.elu(dx), dim=-1)
        y.backward(torch.ones_like(y))
        grad_placements, grad_full = dx.grad.placements, dx.grad.full_tensor()
    ref = x.clone().requires_grad_()
    F.glu(F.elu(ref), dim=-1).sum().backward()
    assert grad_placements == (Shard(0), Shard(1))
    torch.testing.assert_close(grad_full, ref.grad)


def test_end_to_end_summed_loss_is_partial_and_its_gradient_sharded(installed):
    """mse_loss(reduction="sum") of token-sharded predictions is a Partial(sum) scalar, with no collective until
    it is read; its gradient (and PReLU's) stays sharded like the input."""
    x, target = sample_tensor((6, 4)), sample_tensor((6, 4), seed=1)
    slope = torch.tensor([0.25])
    with simulated_mesh((2, 2)) as mesh:
        dx = distribute_tensor(x, mesh, [Shard(0), Shard(1)]).requires_grad_()
        dt = distribute_tensor(target, mesh, [Shard(0), Shard(1)])
        dslope = distribute_tensor(slope, mesh, [Replicate(), Replicate()])
        loss = F.mse_loss(F.prelu(dx, dslope), dt, reduction="sum")
        loss_placements = loss.placements
        loss.backward()
        grad_placements, grad_full, loss_full = dx.grad.placements, dx.grad.full_tensor(), loss.full_tensor()
    ref = x.clone().requires_grad_()
    ref_loss = F.mse_loss(F.prelu(ref, slope), target, reduction="sum")
    ref_loss.backward()
    assert loss_placements == (Partial("sum"), Partial("sum"))
    assert grad_placements == (Shard(0), Shard(1))
    torch.testing.assert_close(loss_full, ref_loss)
    torch.testing.assert_close(grad_full, ref.grad)


@st.composite
def margin_loss_samples(draw, mesh_size):
    """Scores [N, C] (or one sample [C]) with N a multiple of the mesh size for the forward (even shards only),
    and any N for the backward; class targets, multilabel targets (-1 ends a row's labels), class weights."""
    classes = draw(st.integers(1, 4))
    batch = draw(st.sampled_from([None, mesh_size, 2 * mesh_size, draw(st.integers(1, 5))]))
    shape = (batch, classes) if batch else (classes,)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    target = torch.randint(0, classes, shape[:-1], generator=generator)
    labels = torch.randint(-1, classes, shape, generator=generator)
    weight = sample_tensor((classes,), seed=3).abs() if draw(st.booleans()) else None
    return sample_tensor(shape), target, labels, weight, draw(st.sampled_from([0, 1, 2]))


@PROVING_MESHES
@given(data=st.data())
def test_margin_losses_and_backward_proven(mesh_shape, data):
    mesh_size = math.prod(mesh_shape)
    x, target, labels, weight, reduction = data.draw(margin_loss_samples(mesh_size))
    even = x.dim() == 1 or x.shape[0] % mesh_size == 0
    margin_args = [x, target, 1, 1.0, weight, reduction]
    if even:
        assert_proven(aten.multi_margin_loss.default, margin_args, rule=pointwise.sample_loss_rule,
                      mesh_shape=mesh_shape)
        assert_proven(aten.multilabel_margin_loss_forward.default, [x, labels, reduction],
                      rule=pointwise.sample_loss_rule, mesh_shape=mesh_shape)
    grad = sample_tensor(aten.multi_margin_loss(*margin_args).shape, seed=2)
    assert_proven(aten.multi_margin_loss_backward.default, [grad, *margin_args],
                  rule=pointwise.sample_loss_backward_rule, mesh_shape=mesh_shape)
    _, is_target = aten.multilabel_margin_loss_forward(x, labels, reduction)
    assert_proven(aten.multilabel_margin_loss_backward.default, [grad, x, labels, reduction, is_target],
                  rule=pointwise.sample_loss_backward_rule, mesh_shape=mesh_shape)



@PROVING_MESHES
@given(shape=shapes(min_dims=0, max_dims=3))
def test_conj_physical_proven(mesh_shape, shape):
    x = torch.complex(sample_tensor(shape), sample_tensor(shape, seed=1))
    assert_proven(aten._conj_physical.default, [x], rule=pointwise.conj_physical_rule, mesh_shape=mesh_shape)
