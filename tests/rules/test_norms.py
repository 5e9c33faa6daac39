"""Proofs for the norms family: batch norm in eval mode sharded on batch/spatial dims (a superset of torch's rules).

torch's own channel-dim rows fail on an empty channel shard (the training forward raises, the eval backward dies
with SIGFPE), so the samples that exercise them have channel counts every proving mesh divides (8, 16); the rows
we add are proven on any sizes, empty shards included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext._compat import Partial, tensor_meta
from dtensor_ext.rules import norms
from dtensor_ext.testing.checker import check_rule, sample_tensor
from dtensor_ext.testing.mesh import simulated_mesh
from tests.rules.proof import (
    PROVING_MESHES,
    assert_proven,
    assert_torch_validator_agrees,
    filled_rows,
    torch_single_dim_rows,
)

aten = torch.ops.aten
DIVISIBLE_CHANNELS = st.sampled_from([8, 16])


def _stats(channels: int):
    weight, bias = sample_tensor((channels,), seed=1), sample_tensor((channels,), seed=2)
    running_mean, running_var = sample_tensor((channels,), seed=3), sample_tensor((channels,), seed=4).abs() + 0.5
    return weight, bias, running_mean, running_var


@st.composite
def bn_inputs(draw, channels=st.integers(1, 5), min_batch=1):
    c = draw(channels)
    spatial = draw(st.lists(st.integers(1, 5), max_size=2))
    x = sample_tensor((draw(st.integers(min_batch, 5)), c, *spatial))
    affine = draw(st.booleans())
    weight, bias, running_mean, running_var = _stats(c)
    return x, (weight if affine else None), (bias if affine else None), running_mean, running_var


@PROVING_MESHES
@given(inputs=bn_inputs())
def test_eval_batch_norm_forward_proven(mesh_shape, inputs):
    x, weight, bias, mean, var = inputs
    assert_proven(aten.native_batch_norm.default, [x, weight, bias, mean, var, False, 0.1, 1e-5],
                  rule=norms.batch_norm_rule, mesh_shape=mesh_shape)
    assert_proven(aten._native_batch_norm_legit_no_training.default, [x, weight, bias, mean, var, 0.1, 1e-5],
                  rule=norms.batch_norm_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(inputs=bn_inputs(channels=DIVISIBLE_CHANNELS, min_batch=2))
def test_training_batch_norm_forward_proven(mesh_shape, inputs):
    x, weight, bias, mean, var = inputs
    assert_proven(aten.native_batch_norm.default, [x, weight, bias, mean.clone(), var.clone(), True, 0.1, 1e-5],
                  rule=norms.batch_norm_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(inputs=bn_inputs(channels=DIVISIBLE_CHANNELS, min_batch=2), train=st.booleans())
def test_batch_norm_backward_proven(mesh_shape, inputs, train):
    x, weight, bias, mean, var = inputs
    _, save_mean, save_invstd = aten.native_batch_norm(x, weight, bias, mean.clone(), var.clone(), train, 0.1, 1e-5)
    args = [sample_tensor(x.shape, seed=9), x, weight, mean, var, save_mean, save_invstd, train, 1e-5,
            [True, weight is not None, weight is not None]]
    assert_proven(aten.native_batch_norm_backward.default, args, rule=norms.batch_norm_backward_rule,
                  mesh_shape=mesh_shape)


@PROVING_MESHES
@given(inputs=bn_inputs())
def test_eval_batch_norm_backward_spatial_rows_proven(mesh_shape, inputs):
    """The rows we add (spatial dims, Partial weight/bias grads) hold for any sizes, empty shards included."""
    x, weight, bias, mean, var = inputs
    _, save_mean, save_invstd = aten.native_batch_norm(x, weight, bias, mean, var, False, 0.1, 1e-5)
    args = [sample_tensor(x.shape, seed=9), x, weight, mean, var, save_mean, save_invstd, False, 1e-5,
            [True, True, True]]

    def added_rows(op, a, k):
        return norms.batch_norm_backward_rule(op, a, k)[1:]

    assert_proven(aten.native_batch_norm_backward.default, args, rule=added_rows, mesh_shape=mesh_shape)


def test_batch_norm_rules_cover_torch_rules():
    x = sample_tensor((4, 8, 3, 2))
    weight, bias, mean, var = _stats(8)
    metas = [tensor_meta(t) for t in (x, weight, bias, mean, var)]
    cases = [
        (aten.native_batch_norm.default, norms.batch_norm_rule, (*metas, training, 0.1, 1e-5))
        for training in (False, True)
    ]
    cases.append((aten._native_batch_norm_legit_no_training.default, norms.batch_norm_rule, (*metas, 0.1, 1e-5)))
    for train in (False, True):
        backward_metas = [metas[0], metas[0], metas[1], metas[3], metas[4], metas[3], metas[4]]
        cases.append((aten.native_batch_norm_backward.default, norms.batch_norm_backward_rule,
                      (*backward_metas, train, 1e-5, [True, True, True])))
    for op, rule, args in cases:
        theirs = torch_single_dim_rows(op, args, {})
        ours = filled_rows(rule, op, args, {})
        assert theirs <= ours, f"{op}: torch offers {theirs - ours} that we do not"
    eval_rows = filled_rows(norms.batch_norm_rule, aten.native_batch_norm.default, (*metas, False, 0.1, 1e-5), {})
    assert {row[0] for row in eval_rows} == {Shard(0), Shard(1), Shard(2), Shard(3), Replicate()}


def test_torch_validator_finds_no_incorrect_rule():
    assert_torch_validator_agrees(
        "nn.functional.batch_norm", upgrade=["aten::native_batch_norm", "aten::native_batch_norm_backward"],
        allow_composite=True,
    )


def _no_comm_forward_backward(fn, x, placements, params, mesh):
    """Run fn forward and backward on a DTensor placed as given; returns (collectives, out, x.grad, param grads)."""
    dx = distribute_tensor(x, mesh, placements).requires_grad_()
    dparams = [distribute_tensor(p, mesh, [Replicate()] * mesh.ndim).requires_grad_() for p in params]
    with CommDebugMode() as comms:
        out = fn(dx, *dparams)
        out.backward(torch.ones_like(out))
    return comms.get_total_counts(), out, dx.grad, [p.grad for p in dparams]


def test_end_to_end_norms_shard_without_communication():
    """Sequence-sharded LayerNorm/RMSNorm (torch's rules) and spatially sharded eval BatchNorm (ours, upgraded) run
    forward and backward with no collective; weight gradients come out Partial(sum)."""
    x = sample_tensor((4, 6, 8))
    w8 = sample_tensor((8,), seed=1)
    weight, bias, mean, var = _stats(6)
    try:
        dtensor_ext.install(upgrade=["aten::native_batch_norm", "aten::native_batch_norm_backward"])
        with simulated_mesh((2, 2)) as mesh:
            running = [distribute_tensor(t, mesh, [Replicate(), Replicate()]) for t in (mean, var)]
            runs = {
                "layer_norm": _no_comm_forward_backward(
                    lambda t, w: F.layer_norm(t, [8], w, w), x, [Shard(0), Shard(1)], [w8], mesh),
                "rms_norm": _no_comm_forward_backward(
                    lambda t, w: F.rms_norm(t, [8], w), x, [Shard(0), Shard(1)], [w8], mesh),
                "batch_norm": _no_comm_forward_backward(
                    lambda t, w, b: F.batch_norm(t, *running, w, b, training=False), x, [Shard(2), Shard(2)],
                    [weight, bias], mesh),
            }
            results = {
                name: (comms, out.placements, grad.placements, [g.placements for g in pgrads],
                       out.full_tensor(), grad.full_tensor(), [g.full_tensor() for g in pgrads])
                for name, (comms, out, grad, pgrads) in runs.items()
            }
    finally:
        dtensor_ext.install()
    references = {
        "layer_norm": (lambda t, w: F.layer_norm(t, [8], w, w), [w8]),
        "rms_norm": (lambda t, w: F.rms_norm(t, [8], w), [w8]),
        "batch_norm": (lambda t, w, b: F.batch_norm(t, mean, var, w, b, training=False), [weight, bias]),
    }
    for name, (comms, out_pl, grad_pl, pgrad_pl, out, grad, pgrads) in results.items():
        assert comms == 0, f"{name}: {comms} collectives"
        assert out_pl == grad_pl and Replicate() not in out_pl, (name, out_pl, grad_pl)
        assert all(p == (Partial("sum"), Partial("sum")) for p in pgrad_pl), (name, pgrad_pl)
        fn, params = references[name]
        ref_x = x.clone().requires_grad_()
        ref_params = [p.clone().requires_grad_() for p in params]
        fn(ref_x, *ref_params).sum().backward()
        torch.testing.assert_close(out, fn(x, *params))
        torch.testing.assert_close(grad, ref_x.grad)
        for got, ref in zip(pgrads, ref_params):
            torch.testing.assert_close(got, ref.grad)


def test_end_to_end_eval_batch_norm_stays_sharded():
    """Eval-mode batch norm on a batch-sharded input: no communication, output sharded like the input."""
    x = sample_tensor((6, 3, 5))
    weight, bias, mean, var = _stats(3)
    try:
        dtensor_ext.install(upgrade=["aten::native_batch_norm"])
        with simulated_mesh((2, 2)) as mesh:
            dx = distribute_tensor(x, mesh, [Shard(0), Shard(2)])
            rep = [Replicate(), Replicate()]
            stats = [distribute_tensor(t, mesh, rep) for t in (mean, var, weight, bias)]
            out = F.batch_norm(dx, *stats, training=False)
            placements, full = out.placements, out.full_tensor()
    finally:
        dtensor_ext.install()
    assert placements == (Shard(0), Shard(2))
    torch.testing.assert_close(full, F.batch_norm(x, mean, var, weight, bias, training=False))


# group norm backward: a rule plus per-rank N/C/HxW (torch 2.13 raises on a batch-sharded backward). The proofs
# check the declared rule itself, so they hold on every torch; a torch without per-rank scalar adjusters leaves the
# rule out (registry: "needs newer torch"), and shards neither group norm's forward nor its backward by batch.


def _group_norm_backward_args(n, groups, spatial, mask, with_weight=True):
    """float64: the linear rows add Partial pieces with large offsets, which float32 rounding cannot take."""
    channels = 2 * groups
    x = sample_tensor((n, channels, spatial), torch.float64)
    weight = sample_tensor((channels,), torch.float64, seed=1) if with_weight else None
    out, mean, rstd = torch.ops.aten.native_group_norm(x, weight, None, n, channels, spatial, groups, 1e-5)
    if not with_weight:  # autograd never asks for weight/bias gradients without a weight
        mask = [mask[0], False, False]
    return (sample_tensor(out.shape, torch.float64, seed=3), x, mean, rstd, weight, n, channels, spatial, groups, mask)


@given(n=st.integers(1, 9), groups=st.integers(1, 3), spatial=st.integers(1, 4),
       mask=st.sampled_from([[True, True, True], [True, False, False], [True, True, False]]),
       with_weight=st.booleans())
def test_group_norm_backward_proven_with_local_scalars(mesh_shape, n, groups, spatial, mask, with_weight):
    args = _group_norm_backward_args(n, groups, spatial, mask, with_weight)
    report = check_rule(torch.ops.aten.native_group_norm_backward.default, args, mesh_shape=mesh_shape,
                        rule=norms.group_norm_backward_rule, search_missing=False)
    assert report.ok, str(report)


def test_group_norm_backward_batch_rows_are_wrong_without_local_scalars():
    args = _group_norm_backward_args(4, 2, 3, [True, True, True])
    report = check_rule(torch.ops.aten.native_group_norm_backward.default, args, mesh_shape=(2,),
                        rule=norms.group_norm_backward_rule, search_missing=False, local_scalars=lambda a, shapes: a)
    assert any("S(0)" in str(f.combination) for f in report.failures)


@pytest.mark.skipif(not _compat.can_adjust_scalars(), reason=f"the rule is left out: {_compat.SCALAR_ADJUSTERS}")
def test_batch_sharded_group_norm_forward_and_backward_match_one_device(mesh_2d):
    torch.manual_seed(0)
    layer = torch.nn.GroupNorm(2, 6)
    x = torch.randn(5, 6, 4, requires_grad=True)  # 5 samples on 2 ranks: uneven
    layer(x).pow(2).sum().backward()
    dx = distribute_tensor(x.detach(), mesh_2d, [Shard(0), Replicate()]).requires_grad_()
    weight = distribute_tensor(layer.weight.detach(), mesh_2d, [Replicate(), Replicate()]).requires_grad_()
    bias = distribute_tensor(layer.bias.detach(), mesh_2d, [Replicate(), Replicate()]).requires_grad_()
    F.group_norm(dx, 2, weight, bias).pow(2).sum().backward()
    assert dx.grad.placements == (Shard(0), Replicate())
    assert weight.grad.placements == (Partial("sum"), Replicate())
    torch.testing.assert_close(dx.grad.full_tensor(), x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.full_tensor(), layer.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias.grad.full_tensor(), layer.bias.grad, rtol=1e-5, atol=1e-5)
