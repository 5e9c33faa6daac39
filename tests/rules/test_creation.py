"""Proofs for the creation family: linspace/logspace with tensor endpoints (Partial endpoints pass through linspace)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_ext._compat import Partial
from dtensor_ext.rules import creation
from dtensor_ext.testing.mesh import simulated_mesh
from tests.rules.proof import PROVING_MESHES, assert_proven, assert_torch_validator_agrees

aten = torch.ops.aten
ENDPOINT = st.floats(-4, 4, allow_nan=False, width=32)


def _endpoints(overload, start, end):
    """The (start, end) arguments of one overload: 0-d float64 tensors where it takes tensors."""
    as_tensor = {"Tensor_Tensor": (True, True), "Tensor_Scalar": (True, False),
                 "Scalar_Tensor": (False, True)}[overload]
    return [torch.tensor(v, dtype=torch.float64) if t else v for v, t in zip((start, end), as_tensor)]


@PROVING_MESHES
@given(overload=st.sampled_from(creation._OVERLOADS), start=ENDPOINT, end=ENDPOINT, steps=st.integers(0, 9),
       dtype=st.sampled_from([None, torch.float64, torch.int64]))
def test_linspace_proven(mesh_shape, overload, start, end, steps, dtype):
    op = getattr(aten.linspace, overload)
    assert_proven(op, [*_endpoints(overload, start, end), steps], {"dtype": dtype}, rule=creation.linspace_rule,
                  mesh_shape=mesh_shape)


@PROVING_MESHES
@given(overload=st.sampled_from(creation._OVERLOADS), start=ENDPOINT, end=ENDPOINT, steps=st.integers(0, 9),
       base=st.sampled_from([2.0, 10.0]))
def test_logspace_proven(mesh_shape, overload, start, end, steps, base):
    op = getattr(aten.logspace, overload)
    assert_proven(op, [*_endpoints(overload, start, end), steps, base], rule=creation.logspace_rule,
                  mesh_shape=mesh_shape)


def test_torch_validator_finds_no_incorrect_rule():
    # the OpInfo samples have 0-d endpoints only: nothing to shard, so run for false positives only
    for name in ("linspace", "logspace"):
        assert_torch_validator_agrees(name, exercised=False)


def test_end_to_end_linspace_of_partial_endpoints(installed):
    """linspace between two per-rank sums (Partial(sum) scalars) stays Partial: no all-reduce before it."""
    lows, highs = torch.linspace(-2, 1, 8), torch.linspace(0, 3, 8)
    with simulated_mesh((2, 2)) as mesh:
        start = distribute_tensor(lows, mesh, [Shard(0), Replicate()]).sum()
        end = distribute_tensor(highs, mesh, [Shard(0), Replicate()]).sum()
        assert start.placements == (Partial("sum"), Replicate())
        grid = torch.linspace(start, end, 7)
        grid_placements, grid_full = grid.placements, grid.full_tensor()
        log_grid = torch.logspace(start / 8, end / 8, 7)
        log_placements, log_full = log_grid.placements, log_grid.full_tensor()
    assert grid_placements == (Partial("sum"), Replicate())
    torch.testing.assert_close(grid_full, torch.linspace(lows.sum(), highs.sum(), 7))
    assert log_placements == (Replicate(), Replicate())
    torch.testing.assert_close(log_full, torch.logspace(lows.sum() / 8, highs.sum() / 8, 7))
