"""Proofs for the copies family (copying variants of views): moved dims shard unevenly, every Partial passes,
cut dims (narrow's, unfold's) stay whole."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from dtensor_ext._compat import Partial
from dtensor_ext.rules import copy_ops
from dtensor_ext.testing.checker import sample_tensor
from dtensor_ext.testing.mesh import place_dtensor, simulated_mesh
from dtensor_ext.testing.strategies import shapes
from tests.rules.proof import PROVING_MESHES, assert_proven, assert_torch_validator_agrees

aten = torch.ops.aten


def _dim(data, ndim: int, extra: int = 0) -> int:
    """A dim index, negative ones included, for a tensor of `ndim` dims (`extra`: positions past the last)."""
    size = max(ndim + extra, 1)
    return data.draw(st.integers(-size, size - 1))


@PROVING_MESHES
@given(shape=shapes(min_dims=0, max_dims=3), data=st.data())
def test_permute_copy_proven(mesh_shape, shape, data):
    order = data.draw(st.permutations(range(len(shape))))
    order = [d - len(shape) if data.draw(st.booleans()) else d for d in order]
    assert_proven(aten.permute_copy.default, [sample_tensor(shape), order], rule=copy_ops.permute_copy_rule,
                  mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=0, max_dims=2))
def test_t_copy_and_alias_copy_proven(mesh_shape, shape):
    x = sample_tensor(shape)
    assert_proven(aten.t_copy.default, [x], rule=copy_ops.t_copy_rule, mesh_shape=mesh_shape)
    assert_proven(aten.alias_copy.default, [x], rule=copy_ops.alias_copy_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=0, max_dims=3), data=st.data())
def test_transpose_copy_proven(mesh_shape, shape, data):
    args = [sample_tensor(shape), _dim(data, len(shape)), _dim(data, len(shape))]
    assert_proven(aten.transpose_copy.int, args, rule=copy_ops.transpose_copy_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=0, max_dims=3), data=st.data())
def test_unsqueeze_copy_proven(mesh_shape, shape, data):
    args = [sample_tensor(shape), _dim(data, len(shape), extra=1 if shape else 0)]
    assert_proven(aten.unsqueeze_copy.default, args, rule=copy_ops.unsqueeze_copy_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=0, max_dims=3), data=st.data())
def test_unfold_copy_proven(mesh_shape, shape, data):
    dim = _dim(data, len(shape))
    length = shape[dim] if shape else 1
    size = data.draw(st.integers(0 if shape else 1, length))
    step = data.draw(st.integers(1, 3))
    args = [sample_tensor(shape), dim, size, step]
    assert_proven(aten.unfold_copy.default, args, rule=copy_ops.unfold_copy_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=1, max_dims=3), data=st.data())
def test_narrow_copy_proven(mesh_shape, shape, data):
    dim = _dim(data, len(shape))
    start = data.draw(st.integers(0, shape[dim]))
    length = data.draw(st.integers(0, shape[dim] - start))
    args = [sample_tensor(shape), dim, start, length]
    assert_proven(aten.narrow_copy.default, args, rule=copy_ops.narrow_copy_rule, mesh_shape=mesh_shape)


def test_torch_validator_finds_no_wrong_copy_rule():
    for name in ("permute_copy", "t_copy", "transpose_copy", "unsqueeze_copy", "unfold_copy", "narrow_copy",
                 "alias_copy"):
        assert_torch_validator_agrees(name)


def test_sharded_and_partial_inputs_stay_local(installed):
    """An uneven shard moves with its dim and a Partial input stays Partial: no collective, right values."""
    x = sample_tensor((5, 3, 4))
    with simulated_mesh((2, 2)) as mesh:
        sharded = distribute_tensor(x, mesh, [Shard(0), Shard(2)])
        partial = place_dtensor(x, mesh, [Partial("sum"), Shard(0)])
        with CommDebugMode() as comms:
            moved = aten.permute_copy(sharded, [2, 0, 1])
            narrowed = aten.narrow_copy(partial, 2, 1, 2)
        assert comms.get_total_counts() == 0
        results = [(moved.placements, moved.full_tensor()), (narrowed.placements, narrowed.full_tensor())]
    assert results[0][0] == (Shard(1), Shard(0))
    torch.testing.assert_close(results[0][1], x.permute(2, 0, 1))
    assert results[1][0] == (Partial("sum"), Shard(0))
    torch.testing.assert_close(results[1][1], x.narrow(2, 1, 2))
