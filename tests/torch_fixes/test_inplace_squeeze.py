"""squeeze_ that leaves the placements alone kept the DTensor's old shape (quantile of a 0-d tensor)."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from tests.torch_fixes.sharded_runs import agrees, correct_runs_without_and_with_fixes, torch_shards

aten = torch.ops.aten
# 2.11 has a strategy for squeeze_.dim only: the other overloads are refused there (an error, no wrong shape to fix)
needs_strategy = {op: pytest.mark.skipif(not torch_shards(op), reason=f"torch has no strategy for {op}")
                  for op in (aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims)}

MESHES = pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])
FIX = "squeeze_ keeps the old shape"


@needs_strategy[aten.squeeze_.dim]
def test_quantile_of_a_0d_tensor_claims_shape_1_in_torch(fixed_ops, torch_only):
    x = torch.tensor(3.0)
    with simulated_mesh((2,)) as mesh:
        out = torch.quantile(place_dtensor(x, mesh, [Replicate()]), 0.5)
        pieces = {tuple(v.shape) for v in local_values(out).values()}
        if "aten::squeeze_.dim" in fixed_ops[FIX]:
            assert out.shape == (1,) and pieces == {()}
        else:
            assert out.shape == () and agrees(out, torch.quantile(x, 0.5))


@needs_strategy[aten.squeeze_.dim]
@pytest.mark.parametrize("name", ["quantile", "nanquantile"])
def test_quantile_of_a_0d_tensor_is_0d_when_fixed(name):
    x = torch.tensor(3.0)
    with simulated_mesh((2,)) as mesh:
        out = getattr(torch, name)(place_dtensor(x, mesh, [Replicate()]), 0.25)
        assert out.shape == () and agrees(out, getattr(torch, name)(x, 0.25))


SQUEEZES = {
    "all": lambda x: x.squeeze_(),
    "dim": lambda x: x.squeeze_(1),
    "dims": lambda x: x.squeeze_((1, 3)),
}
OVERLOADS = {"all": aten.squeeze_.default, "dim": aten.squeeze_.dim, "dims": aten.squeeze_.dims}


@MESHES
@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_strategy[OVERLOADS[n]]) for n in sorted(SQUEEZES)])
def test_squeeze_in_place_gives_the_squeezed_shape_for_every_layout_when_fixed(mesh_shape, name):
    """[5, 1, 4, 1] in every layout leaving its size-1 dims alone: self is squeezed, pieces and claim agree."""
    squeeze = SQUEEZES[name]
    torch.manual_seed(0)
    x = torch.randn(5, 1, 4, 1)
    expected = squeeze(x.clone())
    for placements in ([Replicate()], [Shard(0)], [Shard(2)], [Replicate(), Shard(0)], [Shard(0), Shard(2)],
                       [Shard(2), Shard(2)]):
        if len(placements) != len(mesh_shape):
            continue
        with simulated_mesh(mesh_shape) as mesh:
            d = place_dtensor(x, mesh, placements)
            out = squeeze(d)
            assert out is d and out.shape == expected.shape and out.stride() == expected.stride(), placements
            assert {v.ndim for v in local_values(out).values()} == {expected.ndim}, placements
            assert agrees(out, expected), placements


@needs_strategy[aten.squeeze_.dim]
@MESHES
def test_squeeze_cases_torch_got_right_keep_their_placements_and_collectives(mesh_shape):
    """Where the squeezed dim moves a shard's index (Shard(2) of [4, 1, 5] -> Shard(1)), torch was right. (With
    the planner on, torch alone's Partial results, which still claim [4, 1, 5] around [4, 5] pieces, read back
    wrong; the fixed ones are right: the fix may add cases, never change one torch got right.)"""
    torch.manual_seed(0)
    torch_results, fixed_results = correct_runs_without_and_with_fixes(
        lambda d: d.clone().squeeze_(1), torch.randn(4, 1, 5), mesh_shape)
    assert len(torch_results) >= 3
    assert {layout: fixed_results.get(layout) for layout in torch_results} == torch_results
