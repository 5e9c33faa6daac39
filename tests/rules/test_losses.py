"""Losses (pointwise family): torch 2.13's decomposition fallback gets these wrong on sharded inputs; ours are proven."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.testing import check_rule, sample_tensor
from dtensor_ext.testing.strategies import shapes

aten = torch.ops.aten
FORWARD = {
    "mse": (aten.mse_loss.default, ()),
    "smooth_l1": (aten.smooth_l1_loss.default, (0.5,)),
    "huber": (aten.huber_loss.default, (0.7,)),
    "soft_margin": (aten.soft_margin_loss.default, ()),
}
BACKWARD = {
    "mse": aten.mse_loss_backward.default,
    "smooth_l1": aten.smooth_l1_loss_backward.default,
    "huber": aten.huber_loss_backward.default,
    "soft_margin": aten.soft_margin_loss_backward.default,
}


@pytest.mark.parametrize("loss", sorted(FORWARD))
@given(shape=shapes(max_dims=3), reduction=st.sampled_from([0, 1, 2]))
def test_forward_and_backward_rules_are_proven(loss, mesh_shape, shape, reduction):
    op, extra = FORWARD[loss]
    x, target = sample_tensor(shape), sample_tensor(shape, seed=1)
    report = check_rule(op, (x, target, reduction, *extra), mesh_shape=mesh_shape, search_missing=False)
    assert report.ok, str(report)
    grad_out = sample_tensor(shape if reduction == 0 else (), seed=2)
    report = check_rule(
        BACKWARD[loss], (grad_out, x, target, reduction, *extra), mesh_shape=mesh_shape, search_missing=False
    )
    assert report.ok, str(report)


@pytest.mark.parametrize("loss", sorted(FORWARD))
def test_mean_reduction_is_never_sharded_even_though_a_1d_sample_may_allow_it(loss):
    op, extra = FORWARD[loss]
    report = check_rule(op, (sample_tensor((5, 3)), sample_tensor((5, 3), seed=1), 1, *extra), mesh_shape=(2,))
    assert report.rows == 1  # all-Replicate only: 5 rows split 3/2 make the mean of means wrong


@pytest.mark.parametrize("shape", [(4, 6), (5, 6)])
def test_batch_sharded_mse_matches_one_device_where_torch_alone_is_wrong(mesh_1d2, shape):
    x = torch.randn(shape, requires_grad=True)
    target = torch.randn(shape)
    F.mse_loss(x, target).backward()

    def sharded_loss_and_grad():
        dx = distribute_tensor(x.detach(), mesh_1d2, [Shard(0)]).requires_grad_()
        loss = F.mse_loss(dx, distribute_tensor(target, mesh_1d2, [Shard(0)]))
        loss.backward()
        return loss.full_tensor(), dx.grad.full_tensor()

    loss, grad = sharded_loss_and_grad()
    torch.testing.assert_close(loss, F.mse_loss(x, target))
    torch.testing.assert_close(grad, x.grad)

    dtensor_ext.uninstall()  # what torch computes without the package
    try:
        torch_path = _compat.torch_strategy_kind(aten.mse_loss_backward.default)
        _, torch_grad = sharded_loss_and_grad()
    finally:
        dtensor_ext.install()
    if torch_path == "decomposition":  # torch 2.13-2.14: the gradient is divided by the local element count
        assert not torch.allclose(torch_grad, x.grad)
