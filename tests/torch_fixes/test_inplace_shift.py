"""In-place scalar shifts keep Partial(avg/max/min): the reductions commute with adding a constant."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh


FIX = "in-place scalar shift refuses Partial(avg/max/min)"


def _values(t) -> list[torch.Tensor]:
    return list(local_values(t.full_tensor()).values())


@pytest.mark.parametrize("reduce_op", ["avg", "max", "min"])
@pytest.mark.parametrize("shift", ["add_", "sub_"])
def test_shift_of_partial_is_refused_by_torch_and_local_when_fixed(fixed_ops, fix_state, reduce_op, shift):
    """Where the feature check finds the rows missing, torch alone refuses; elsewhere it is local and right too."""
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    expected = getattr(x.clone(), shift)(0.5)
    with simulated_mesh((4,)) as mesh:
        t = place_dtensor(x, mesh, [Partial(reduce_op)])
        if fix_state == "torch only" and f"aten::{shift}.Scalar" in fixed_ops[FIX]:
            with pytest.raises(RuntimeError, match="in-place operations that require placement changes"):
                getattr(t, shift)(0.5)
            return
        with CommDebugMode() as comms:
            getattr(t, shift)(0.5)
        assert t.placements == (Partial(reduce_op),) and comms.get_total_counts() == 0
        assert all(torch.allclose(v, expected, atol=1e-6) for v in _values(t))


def test_partial_sum_stays_refused():
    with simulated_mesh((4,)) as mesh:
        t = place_dtensor(torch.randn(5), mesh, [Partial("sum")])
        with pytest.raises(RuntimeError, match="in-place operations that require placement changes"):
            t.add_(1.0)


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()], ids=str)
def test_shifts_torch_got_right_are_unchanged(placement):
    results = []
    for fix in (False, True):
        dtensor_ext.install(fix_torch=fix)
        with simulated_mesh((2, 2)) as mesh:
            t = place_dtensor(torch.ones(5, 3), mesh, [placement, Replicate()])
            with CommDebugMode() as comms:
                t.add_(2.0)
                out_of_place = place_dtensor(torch.ones(5, 3), mesh, [Partial("avg"), placement]) + 2.0
            results.append((t.placements, out_of_place.placements, comms.get_comm_counts()))
            assert all(torch.equal(v, torch.full((5, 3), 3.0)) for v in _values(t) + _values(out_of_place))
    dtensor_ext.install()
    assert results[0] == results[1]


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])
def test_rms_norm_sharded_on_the_normalized_dim(fixed_ops, fix_state, mesh_shape):
    """The user-visible effect: F.rms_norm's decomposition does mean(x * x).add_(eps) over the sharded dim, which
    is Partial(avg) when that dim is evenly sharded (uneven shards take torch's Partial(sum) path, which works)."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 4), torch.randn(4)
    expected = F.rms_norm(x, (4,), w, eps=1e-5)
    with simulated_mesh(mesh_shape) as mesh:
        xd = place_dtensor(x, mesh, [Shard(1)] + [Replicate()] * (len(mesh_shape) - 1))
        wd = place_dtensor(w, mesh, [Replicate()] * len(mesh_shape))
        if fix_state == "torch only" and "aten::add_.Scalar" in fixed_ops[FIX]:
            with pytest.raises(RuntimeError, match="add_.Scalar"):
                F.rms_norm(xd, (4,), wd, eps=1e-5)
            return
        out = F.rms_norm(xd, (4,), wd, eps=1e-5)
        assert all(torch.allclose(v, expected, atol=1e-5) for v in _values(out))


def test_shift_by_a_replicated_tensor_keeps_partial_avg():
    torch.manual_seed(0)
    x, y = torch.randn(5, 3), torch.randn(3)
    with simulated_mesh((4,)) as mesh:
        t = place_dtensor(x, mesh, [Partial("avg")])
        with CommDebugMode() as comms:
            t.add_(place_dtensor(y, mesh, [Replicate()]))
        assert t.placements == (Partial("avg"),) and comms.get_total_counts() == 0
        assert all(torch.allclose(v, x + y, atol=1e-6) for v in _values(t))
