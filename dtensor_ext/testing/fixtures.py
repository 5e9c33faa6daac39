"""pytest fixtures for simulated meshes; enable with ``pytest_plugins = ["dtensor_ext.testing.fixtures"]``."""

from __future__ import annotations

import pytest

from dtensor_ext.testing.mesh import MESH_SHAPES, simulated_mesh


def _mesh_fixture(key: str):
    @pytest.fixture(name=f"mesh_{key}")
    def mesh_fixture():
        with simulated_mesh(MESH_SHAPES[key]) as mesh:
            yield mesh

    mesh_fixture.__doc__ = f"A simulated mesh of shape {MESH_SHAPES[key]}."
    return mesh_fixture


mesh_1d2 = _mesh_fixture("1d2")
mesh_1d4 = _mesh_fixture("1d4")
mesh_2d = _mesh_fixture("2d")
mesh_3d = _mesh_fixture("3d")


@pytest.fixture(params=list(MESH_SHAPES), ids=list(MESH_SHAPES))
def sim_mesh(request):
    """Every proving mesh in turn: 1-D (2 and 4 ranks), 2-D 2x2, 3-D 2x2x2."""
    with simulated_mesh(MESH_SHAPES[request.param]) as mesh:
        yield mesh


@pytest.fixture(scope="session", params=list(MESH_SHAPES.values()), ids=list(MESH_SHAPES))
def mesh_shape(request):
    """The proving mesh shapes, for checks that need no live mesh (the rule checker)."""
    return request.param
