"""hypothesis strategies for shapes (even and uneven), meshes and placements.

Profiles: ``ci`` (fast, the default) and ``thorough``; pick one with DTENSOR_EXT_HYPOTHESIS_PROFILE.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from dtensor_ext._compat import Partial, Placement, Replicate, Shard
from dtensor_ext.testing.mesh import MESH_SHAPES

__all__ = ["dims", "shapes", "mesh_shapes", "placements", "placements_for", "load_profile"]

settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def load_profile() -> str:
    name = os.environ.get("DTENSOR_EXT_HYPOTHESIS_PROFILE", "ci")
    settings.load_profile(name)
    return name


def dims(*, min_size: int = 1, max_size: int = 9) -> st.SearchStrategy[int]:
    """Tensor dim sizes; the range covers sizes below, at, and not divisible by the mesh sizes (uneven shards)."""
    return st.integers(min_value=min_size, max_value=max_size)


def shapes(*, min_dims: int = 1, max_dims: int = 3, min_size: int = 1, max_size: int = 9):
    return st.lists(dims(min_size=min_size, max_size=max_size), min_size=min_dims, max_size=max_dims).map(tuple)


def mesh_shapes(*, max_ndim: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    return st.sampled_from([s for s in MESH_SHAPES.values() if len(s) <= max_ndim])


def placements(ndim: int, *, partial: Sequence[str] = ("sum",)) -> st.SearchStrategy[Placement]:
    """One placement for a tensor of `ndim` dims: Replicate, Shard on any dim, or Partial of the given kinds."""
    options: list[st.SearchStrategy[Placement]] = [st.just(Replicate())]
    if ndim:
        options.append(st.integers(0, ndim - 1).map(Shard))
    if partial:
        options.append(st.sampled_from(list(partial)).map(Partial))
    return st.one_of(options)


def placements_for(ndim: int, mesh_ndim: int, *, partial: Sequence[str] = ("sum",)):
    """A placement per mesh dim for one tensor."""
    return st.lists(placements(ndim, partial=partial), min_size=mesh_ndim, max_size=mesh_ndim).map(tuple)
