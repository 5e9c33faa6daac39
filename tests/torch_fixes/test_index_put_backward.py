"""Gradients through `index_put` (`y = x.index_put(idx, v)`, what `y[idx] = v` on a copy does) of DTensors on 1-D,
2-D and 3-D simulated meshes, uneven shards included, equal one device's, for `self` and `values`, with and without
accumulate. Without the fix the backward zeroes the written positions with plain zeros, which DTensor refuses."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from dtensor_ext.testing import place_dtensor, sample_tensor, simulated_mesh
from tests.torch_fixes.sharded_runs import agrees

FIX = "index_put backward writes plain zeros"

# mesh shape -> layouts of the (7, 5) `self` and the (3, 5) values: the unindexed dim 1 split unevenly, or whole
MESHES = {
    (3,): [[Shard(1)], [Replicate()]],
    (2, 2): [[Replicate(), Shard(1)], [Shard(1), Replicate()]],
    (2, 2, 2): [[Replicate(), Shard(1), Replicate()]],
}
INDEX = torch.tensor([4, 0, 6])


def _written(x, values, index, accumulate):
    return x.index_put((index,), values, accumulate=accumulate)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=str)
def test_index_put_gradients_equal_one_device(mesh_shape, accumulate):
    x, values = sample_tensor((7, 5)).requires_grad_(), sample_tensor((3, 5), seed=1).requires_grad_()
    weights = sample_tensor((7, 5), seed=2)  # a gradient that is not all ones
    (_written(x, values, INDEX, accumulate) * weights).sum().backward()
    for placements in MESHES[mesh_shape]:
        with simulated_mesh(mesh_shape) as mesh:
            replicated = [Replicate()] * len(mesh_shape)
            d_x = place_dtensor(x.detach(), mesh, placements).requires_grad_()
            d_values = place_dtensor(values.detach(), mesh, placements).requires_grad_()
            out = _written(d_x, d_values, place_dtensor(INDEX, mesh, replicated), accumulate)
            (out * place_dtensor(weights, mesh, replicated)).sum().backward()
            assert agrees(d_x.grad, x.grad), placements
            assert agrees(d_values.grad, values.grad), placements


def test_torch_alone_fails_where_the_check_finds_the_defect(fixed_ops, torch_only):
    """Where the fix applies, torch alone's backward raises on DTensors (never a wrong gradient); elsewhere it equals
    one device."""
    x = sample_tensor((4, 6)).requires_grad_()
    values = sample_tensor((2, 6), seed=1)
    _written(x, values, torch.tensor([1, 3]), False).sum().backward()
    with simulated_mesh((2,)) as mesh:
        d_x = place_dtensor(x.detach(), mesh, [Replicate()]).requires_grad_()
        loss = _written(d_x, place_dtensor(values, mesh, [Replicate()]),
                        place_dtensor(torch.tensor([1, 3]), mesh, [Replicate()]), False).sum()
        if fixed_ops[FIX]:
            with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
                loss.backward()
        else:
            loss.backward()
            assert agrees(d_x.grad, x.grad)
