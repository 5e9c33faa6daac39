"""pytest fixtures for simulated meshes; enable with ``pytest_plugins = ["dtensor_ext.testing.fixtures"]``."""

from __future__ import annotations

import pytest

from dtensor_ext.testing.mesh import MESH_SHAPES, simulated_mesh


@pytest.fixture
def mesh_1d2():
    with simulated_mesh(MESH_SHAPES["1d2"]) as mesh:
        yield mesh


@pytest.fixture
def mesh_1d4():
    with simulated_mesh(MESH_SHAPES["1d4"]) as mesh:
        yield mesh


@pytest.fixture
def mesh_2d():
    with simulated_mesh(MESH_SHAPES["2d"]) as mesh:
        yield mesh


@pytest.fixture
def mesh_3d():
    with simulated_mesh(MESH_SHAPES["3d"]) as mesh:
        yield mesh


@pytest.fixture(params=list(MESH_SHAPES), ids=list(MESH_SHAPES))
def sim_mesh(request):
    """Every proving mesh in turn: 1-D (2 and 4 ranks), 2-D 2x2, 3-D 2x2x2."""
    with simulated_mesh(MESH_SHAPES[request.param]) as mesh:
        yield mesh


@pytest.fixture(scope="session", params=list(MESH_SHAPES.values()), ids=list(MESH_SHAPES))
def mesh_shape(request):
    """The proving mesh shapes, for checks that need no live mesh (the rule checker)."""
    return request.param
