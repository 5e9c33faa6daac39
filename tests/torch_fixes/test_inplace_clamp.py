"""In-place clamps of a Partial tensor: exact (reduce, clamp, lay out again as `self`), `self` keeps its layout."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from dtensor_ext.testing.mesh import LocalTensor

FIX = "in-place clamp refuses a Partial self"
REFUSAL = "in-place operations that require placement changes"


def _values(t) -> list[torch.Tensor]:
    return list(local_values(t.full_tensor()).values())


def _partial_from_pieces(pieces: dict[int, torch.Tensor], mesh) -> DTensor:
    shape = next(iter(pieces.values())).shape
    return DTensor.from_local(LocalTensor(pieces), mesh, [Partial()], run_check=False, shape=shape,
                              stride=torch.empty(shape).stride())


def _crossing_pieces(var: torch.Tensor, eps: float) -> dict[int, torch.Tensor]:
    """Two Partial(sum) pieces of `var`, one above `eps` and one below it everywhere: clamping them one by one
    gives `var + 1 + eps` wherever `var` is above `eps`, not `var`."""
    pieces = {0: var + 1.0, 1: torch.full_like(var, -1.0)}
    assert (pieces[0] > eps).all() and (pieces[1] < eps).all()
    assert not torch.allclose(sum(p.clamp(min=eps) for p in pieces.values()), var.clamp(min=eps))
    return pieces


@pytest.mark.parametrize("op", ["clamp_", "clamp_min_", "clamp_max_", "clamp_ tensor bound"])
@pytest.mark.parametrize("reduce_op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])
def test_inplace_clamp_of_partial(fixed_ops, fix_state, op, reduce_op, mesh_shape):
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    bound = torch.full((3,), 0.2) if op == "clamp_ tensor bound" else 0.2
    clamp = {"clamp_": lambda t, b: t.clamp_(min=b, max=b + 0.5), "clamp_ tensor bound": lambda t, b: t.clamp_(b),
             "clamp_min_": lambda t, b: t.clamp_min_(b), "clamp_max_": lambda t, b: t.clamp_max_(b)}[op]
    expected = clamp(x.clone(), bound)
    placements = [Partial(reduce_op)] + [Shard(0)] * (len(mesh_shape) - 1)
    op_name = "aten::clamp_.Tensor" if op == "clamp_ tensor bound" else f"aten::{op}.default"
    with simulated_mesh(mesh_shape) as mesh:
        t = place_dtensor(x, mesh, placements)
        row = t[:, 1]  # a view: it must see the clamped values in its own (Partial) layout
        row_placements = row.placements
        b = place_dtensor(bound, mesh, [Replicate()] * len(mesh_shape)) if op == "clamp_ tensor bound" else bound
        if fix_state == "torch only" and op_name in fixed_ops[FIX]:
            with pytest.raises(RuntimeError, match=REFUSAL):
                clamp(t, b)
            return
        result = clamp(t, b)
        assert result is t and t.placements == tuple(placements) and row.placements == row_placements
        assert all(torch.allclose(v, expected, atol=1e-6) for v in _values(t))
        assert all(torch.allclose(v, expected[:, 1], atol=1e-6) for v in _values(row))


@pytest.mark.parametrize("placements", [[Shard(0)], [Replicate()], [Shard(1)]], ids=str)
def test_clamps_torch_got_right_are_unchanged(placements):
    results = []
    for fix in (False, True):
        dtensor_ext.install(fix_torch=fix)
        with simulated_mesh((4,)) as mesh:
            t = place_dtensor(torch.arange(15.0).reshape(5, 3), mesh, placements)
            with CommDebugMode() as comms:
                t.clamp_(min=3.0, max=9.0)
            results.append((t.placements, comms.get_comm_counts()))
            assert all(torch.equal(v, torch.arange(15.0).reshape(5, 3).clamp(3.0, 9.0)) for v in _values(t))
    dtensor_ext.install()
    assert results[0] == results[1]


def _clone_keeps_partial() -> bool:
    """Whether torch's `clone` of a Partial(sum) tensor stays Partial (2.15) instead of reducing it (2.13)."""
    spec = _compat.probe_spec(torch.zeros(2, 2), (Partial(),))
    return _compat.output_placements(torch.ops.aten.clone.default, (spec,)) == (Partial(),)


@pytest.mark.parametrize("eps", [1e-6, 0.3])
def test_gaussian_nll_loss_with_partial_var_crossing_the_clamp(fixed_ops, fix_state, eps):
    """gaussian_nll_loss clamps `var.clone()` in place. Exact with the fix; torch alone is right where its clone
    reduces the Partial var first (2.13) and refuses the in-place clamp where it keeps it Partial (2.15)."""
    torch.manual_seed(0)
    x, target = torch.randn(4, 3), torch.randn(4, 3)
    var = torch.rand(4, 3) * 0.5 + 0.1  # 0.1 .. 0.6: the eps = 0.3 threshold runs through it
    expected = F.gaussian_nll_loss(x, target, var, eps=eps)
    with simulated_mesh((2,)) as mesh:
        var_d = _partial_from_pieces(_crossing_pieces(var, eps), mesh)
        x_d, target_d = (place_dtensor(t, mesh, [Replicate()]) for t in (x, target))
        if fix_state == "torch only" and _clone_keeps_partial():
            assert "aten::clamp_.default" in fixed_ops[FIX]
            with pytest.raises(RuntimeError, match=REFUSAL):
                F.gaussian_nll_loss(x_d, target_d, var_d, eps=eps)
            return
        loss = F.gaussian_nll_loss(x_d, target_d, var_d, eps=eps)
        assert all(torch.allclose(v, expected, atol=1e-5) for v in _values(loss))
