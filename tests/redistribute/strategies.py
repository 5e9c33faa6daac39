from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

from dtensor_ext._compat import enabled_local_tensor_mode
from dtensor_ext.testing import rank_coordinates
from dtensor_ext.testing.layout import place

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


def placed_dtensor(mesh, t, placements) -> DTensor:
    """`t` laid out as `placements` on a simulated mesh; Partial dims hold random pieces that reduce to `t`."""
    mode = enabled_local_tensor_mode()
    with mode.disable():  # plain tensors: `place` caches helper tensors, which must not belong to this mesh
        pieces = place(t, placements, tuple(mesh.shape), rank_coordinates(mesh), salt=3)
    local = mode.rank_map(lambda r: pieces[r])
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
