"""histc's sharding-cache key leaves out `bins`: a second call reusing the first one's output spec."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from tests.torch_fixes.sharded_runs import agrees, correct_runs_without_and_with_fixes

MESHES = pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])


def test_histc_reuses_the_bins_of_an_earlier_call_in_torch(fixed_ops, torch_only):
    """histc(bins=1) after histc(bins=3) on the same layout: where the feature check finds the defect, torch alone
    claims shape (3,) around pieces of shape (1,); elsewhere it is right."""
    x = torch.arange(8.0)
    with simulated_mesh((2,)) as mesh:
        d = place_dtensor(x, mesh, [Shard(0)])
        torch.histc(d, 3, 0, 8)
        out = torch.histc(d, 1, 0, 8)
        pieces = {tuple(v.shape) for v in local_values(out).values()}
        if "aten::histc.default" in fixed_ops["histc cache key leaves out bins"]:
            assert out.shape == (3,) and pieces == {(1,)}
        else:
            assert out.shape == (1,) and agrees(out, torch.histc(x, 1, 0, 8))


@MESHES
def test_histc_follows_bins_from_call_to_call_when_fixed(mesh_shape):
    """Every bin count in turn, on sharded and replicated layouts, gives the single-device histogram."""
    torch.manual_seed(0)
    x = torch.rand(6, 5)
    with simulated_mesh(mesh_shape) as mesh:
        for placements in ([Shard(0)] * len(mesh_shape), [Replicate(), Shard(1)][: len(mesh_shape)]):
            d = place_dtensor(x, mesh, placements)
            for bins in (100, 1, 7, 100):
                out = torch.histc(d, bins, 0, 1)
                assert out.shape == (bins,) and agrees(out, torch.histc(x, bins, 0, 1)), (placements, bins)


@MESHES
def test_histc_cases_torch_got_right_keep_their_placements_and_collectives(mesh_shape):
    torch.manual_seed(0)
    torch_results, fixed_results = correct_runs_without_and_with_fixes(
        lambda d: torch.histc(d, 4, 0, 1), torch.rand(5, 4), mesh_shape)
    assert len(torch_results) >= 3
    assert fixed_results == torch_results
