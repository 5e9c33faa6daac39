"""Gradients through topk, sort, max(dim) and min(dim) of DTensors on 1-D, 2-D and 3-D simulated meshes,
with uneven shards and the selected dim split or whole, equal one device's. torch 2.11's backward scattered the
DTensor gradient onto plain zeros and failed; 2.12+ need no fix."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from dtensor_ext.testing import place_dtensor, sample_tensor, simulated_mesh
from tests.torch_fixes.sharded_runs import agrees

FIX = "selection backward scatters onto plain zeros"

SELECTIONS = {
    "topk": lambda t: torch.topk(t, 2, dim=-1).values,  # an MoE router's
    "sort": lambda t: t.sort(dim=0, descending=True).values,
    "max(dim)": lambda t: t.max(dim=-1, keepdim=True).values,
    "min(dim)": lambda t: t.min(dim=0).values,
}

# mesh shape -> layouts of the (5, 7) input: uneven splits of either dim, the selected one included
MESHES = {
    (3,): [[Shard(0)], [Shard(1)], [Replicate()]],
    (2, 2): [[Shard(0), Shard(1)], [Replicate(), Shard(0)]],
    (2, 2, 2): [[Shard(0), Replicate(), Shard(1)]],
}


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=str)
@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_selection_gradients_equal_one_device(selection, mesh_shape):
    x = sample_tensor((5, 7)).requires_grad_()
    weights = sample_tensor(SELECTIONS[selection](x).shape, seed=1)  # a gradient that is not all ones
    (SELECTIONS[selection](x) * weights).sum().backward()
    for placements in MESHES[mesh_shape]:
        with simulated_mesh(mesh_shape) as mesh:
            d_x = place_dtensor(x.detach(), mesh, placements).requires_grad_()
            out = SELECTIONS[selection](d_x)
            (out * place_dtensor(weights, mesh, [Replicate()] * len(mesh_shape))).sum().backward()
            assert agrees(d_x.grad, x.grad), placements


def test_torch_alone_fails_where_the_check_finds_the_defect(fixed_ops, torch_only):
    """Where the fix applies, torch alone's topk backward raises on DTensors (never a wrong gradient); elsewhere
    (2.12+) it equals one device."""
    x = sample_tensor((4, 6)).requires_grad_()
    torch.topk(x, 2, dim=-1).values.sum().backward()
    with simulated_mesh((2,)) as mesh:
        d_x = place_dtensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        loss = torch.topk(d_x, 2, dim=-1).values.sum()
        if fixed_ops[FIX]:
            with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
                loss.backward()
        else:
            loss.backward()
            assert agrees(d_x.grad, x.grad)
