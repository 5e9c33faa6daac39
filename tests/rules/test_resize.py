"""Proofs for resize_ / resize_as_ keeping the shape, and the refusal of shape-changing resizes of DTensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_ext.rules import resize
from dtensor_ext.testing import check_rule
from dtensor_ext.testing.checker import sample_tensor
from dtensor_ext.testing.mesh import simulated_mesh
from dtensor_ext.testing.strategies import shapes
from tests.rules.proof import PROVING_MESHES, assert_proven, assert_torch_validator_agrees

aten = torch.ops.aten


# resize_as_ has ~27 rows (any whole template with any whole self): ~20k combinations on a 3-D mesh; an evenly
# spaced subset keeps CI fast there (1-D and 2-D meshes check every combination).
MAX_COMBINATIONS_3D = 300


@PROVING_MESHES
@given(shape=shapes(min_dims=0, max_dims=3))
def test_resize_keeping_the_shape_proven(mesh_shape, shape):
    x = sample_tensor(shape, torch.float64)
    assert_proven(aten.resize_.default, [x, list(shape)], rule=resize.resize_rule, mesh_shape=mesh_shape)
    report = check_rule(aten.resize_as_.default, [x, sample_tensor(shape, torch.float64, seed=1)],
                        mesh_shape=mesh_shape, rule=resize.resize_as_rule, search_missing=False,
                        max_combinations=MAX_COMBINATIONS_3D if len(mesh_shape) > 2 else None)
    report.assert_ok()


def test_end_to_end_resize(installed):
    """resize_as_ to a same-shaped template keeps the shards in place; a shape-changing resize_ is refused (DTensor
    would otherwise keep claiming the old shape) instead of silently running on the replicated tensor."""
    x = sample_tensor((5, 4))
    with simulated_mesh((2, 2)) as mesh:
        dx = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
        out = dx.resize_as_(distribute_tensor(torch.zeros(5, 4), mesh, [Shard(0), Shard(1)]))
        assert out is dx and out.placements == (Shard(0), Shard(1))
        torch.testing.assert_close(out.full_tensor(), x)
        whole = distribute_tensor(x.clone(), mesh, [Replicate(), Replicate()])
        with pytest.raises(RuntimeError, match=r"resizing a DTensor from \(5, 4\) to \(20,\)"):
            whole.resize_(20)


def test_torch_validator_finds_no_incorrect_rule():
    # the OpInfo samples resize to the same shape (or refuse): whole inputs only, so run for false positives only
    assert_torch_validator_agrees("resize_as_", exercised=False)
