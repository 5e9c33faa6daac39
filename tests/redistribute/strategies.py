from hypothesis import strategies as st

from dtensor_ext.testing.strategies import placements_for, shapes


@st.composite
def execution_requests(draw):
    """(mesh shape, tensor shape, source, target): meshes up to 3-D with <= 8 ranks, shapes even and uneven."""
    mesh_shape = draw(st.sampled_from([(2,), (4,), (2, 2), (2, 2, 2)]))
    shape = draw(shapes(min_dims=1, max_dims=3, max_size=7))
    reduce_op = draw(st.sampled_from(["sum", "max"]))  # DTensor refuses mixed reduce ops in one placement list
    src = draw(placements_for(len(shape), len(mesh_shape), partial=(reduce_op,)))
    dst = draw(placements_for(len(shape), len(mesh_shape), partial=()))
    return mesh_shape, shape, src, dst
