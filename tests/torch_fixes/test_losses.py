"""nll_loss / cross_entropy with a mean over a sharded batch: wrong or refused by torch 2.13, right with the fix."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext.torch_fixes import losses
from dtensor_ext.testing import sample_tensor, simulated_mesh
from dtensor_ext.testing.mesh import place_dtensor

aten = torch.ops.aten
REDUCTIONS = ("none", "mean", "sum")


@pytest.fixture
def torch_alone():
    dtensor_ext.install(fix_torch=False)
    yield
    dtensor_ext.install()


@pytest.fixture
def fixed():
    dtensor_ext.install()
    yield
    dtensor_ext.install()


def _targets(n, classes, seed, ignored=()):
    target = torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))
    target[list(ignored)] = -100
    return target


def _sharded_loss(mesh, x, target, weight, placements, **kwargs):
    """cross_entropy on DTensors, batch laid out as `placements`; returns (full loss, full grad, output placements)."""
    dx = distribute_tensor(x, mesh, placements).requires_grad_()
    dt = distribute_tensor(target, mesh, placements)
    dw = None if weight is None else distribute_tensor(weight, mesh, [Replicate()] * mesh.ndim)
    loss = F.cross_entropy(dx, dt, weight=dw, **kwargs)
    loss.sum().backward()
    return loss.full_tensor(), dx.grad.full_tensor(), loss.placements


def test_torch_alone_averages_shard_means_or_refuses_uneven_batches(torch_alone):
    x, weight = sample_tensor((4, 3)), torch.tensor([1.0, 2.0, 3.0])
    target = torch.tensor([0, 2, 1, 2])  # the two shards' targets weigh 4 and 5
    fix_needed = losses._averages_shard_means(aten.nll_loss_forward.default, ())  # the fix's own check, torch alone
    with simulated_mesh((2,)) as mesh:
        loss, _, placements = _sharded_loss(mesh, x, target, weight, [Shard(0)])
        if not fix_needed:  # torch 2.14 takes the whole batch itself: then it must be right
            assert torch.allclose(loss, F.cross_entropy(x, target, weight=weight))
            return
        assert placements == (Partial("avg"),)
        assert not torch.allclose(loss, F.cross_entropy(x, target, weight=weight))  # the defect: a mean of means
        with pytest.raises(RuntimeError, match="cannot be evenly sharded"):
            _sharded_loss(mesh, sample_tensor((3, 3)), _targets(3, 3, seed=1), None, [Shard(0)])


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_sharded_batch_gives_the_one_device_loss_and_gradient(fixed, mesh_shape, reduction):
    cases = []  # (x, target, weight, loss, grad): even and uneven batches, empty shards (3 rows on 4 ranks)
    for n, weighted, ignored in [(8, True, (1, 6)), (6, False, (2,)), (3, True, ())]:
        x = sample_tensor((n, 5), seed=n)
        target = _targets(n, 5, seed=n, ignored=ignored)
        weight = sample_tensor((5,), seed=7).abs() + 0.5 if weighted else None
        x_ref = x.clone().requires_grad_()
        loss = F.cross_entropy(x_ref, target, weight=weight, reduction=reduction)
        loss.sum().backward()
        cases.append((x, target, weight, loss.detach(), x_ref.grad))
    with simulated_mesh(mesh_shape) as mesh:
        for x, target, weight, expected_loss, expected_grad in cases:
            for placements in ([Shard(0)] * mesh.ndim, [Shard(0), Replicate()][: mesh.ndim]):
                loss, grad, _ = _sharded_loss(mesh, x, target, weight, placements, reduction=reduction)
                torch.testing.assert_close(loss, expected_loss)
                torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("reduction", [0, 2])
def test_layouts_torch_got_right_are_kept_without_extra_collectives(reduction):
    """Unreduced and summed losses: same output placements and collectives with and without the fix."""
    x, target, weight = sample_tensor((8, 5)), _targets(8, 5, seed=4, ignored=(3,)), sample_tensor((5,)).abs()
    seen = {}
    try:
        for fix in (False, True):
            dtensor_ext.install(fix_torch=fix)
            with simulated_mesh((2, 2)) as mesh:
                for placements in ([Shard(0), Shard(0)], [Shard(0), Replicate()], [Replicate(), Replicate()]):
                    comm = CommDebugMode()
                    with comm:
                        out, total_weight = aten.nll_loss_forward(
                            distribute_tensor(x, mesh, placements),
                            distribute_tensor(target, mesh, placements),
                            distribute_tensor(weight, mesh, [Replicate(), Replicate()]),
                            reduction,
                            -100,
                        )
                    seen.setdefault(fix, []).append(
                        (out.placements, total_weight.placements, comm.get_total_counts())
                    )
    finally:
        dtensor_ext.install()
    assert seen[True] == seen[False]


@given(
    batch=st.integers(1, 6),
    classes=st.integers(1, 4),
    images=st.booleans(),
    weighted=st.booleans(),
    reduction=st.sampled_from(REDUCTIONS),
    mesh_shape=st.sampled_from([(4,), (2, 2)]),
    layout=st.lists(st.sampled_from(["S0", "S1", "R", "P"]), min_size=2, max_size=2),
)
def test_any_layout_gives_the_one_device_loss(batch, classes, images, weighted, reduction, mesh_shape, layout):
    spatial = (2, 3) if images else ()
    x = sample_tensor((batch, classes, *spatial))
    target = torch.randint(0, classes, (batch, *spatial), generator=torch.Generator().manual_seed(batch))
    target.view(-1)[0] = -100  # one ignored target
    weight = sample_tensor((classes,), seed=5).abs() + 0.5 if weighted else None
    expected = F.nll_loss(x, target, weight=weight, reduction=reduction)
    by_name = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}
    x_placements = [by_name[n] for n in layout[: len(mesh_shape)]]
    target_placements = [p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in x_placements]
    with simulated_mesh(mesh_shape) as mesh:
        rep = [Replicate()] * mesh.ndim
        loss = F.nll_loss(place_dtensor(x, mesh, x_placements), distribute_tensor(target, mesh, target_placements),
                          weight=None if weight is None else distribute_tensor(weight, mesh, rep), reduction=reduction)
        # every target ignored (batch 1, its one target -100) makes the mean 0/0: NaN on one device and sharded
        torch.testing.assert_close(loss.full_tensor(), expected, equal_nan=True)
