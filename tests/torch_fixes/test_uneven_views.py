"""A view flattening an unevenly sharded dim is refused (no layout aliases it) with the two ways out named; every view
torch accepts, and every other refusal, is what torch does."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from dtensor_ext.view_copies import view_copies

MESHES = pytest.mark.parametrize(
    "mesh_shape, placements",
    [((2,), [Shard(0)]), ((2, 2), [Shard(0), Replicate()]), ((2, 2), [Replicate(), Shard(0)]),
     ((2, 2, 2), [Replicate(), Shard(0), Shard(2)])],
    ids=["1d", "2d-dp", "2d-tp", "3d"],
)

# a batch of 3 over a mesh dim of 2; (batch, seq) flattened as nn.Linear does it (under autograd: aten.view)
FLATTENING = {
    "view": lambda x, w: x.view(-1, 6),
    "reshape": lambda x, w: x.reshape(-1, 6),
    "flatten": lambda x, w: x.flatten(0, 1),
    "linear": lambda x, w: torch.nn.functional.linear(x, w),
}
WEIGHT = torch.randn(5, 6)


def _weight(mesh):
    return place_dtensor(WEIGHT, mesh, [Replicate()] * mesh.ndim).requires_grad_()


@MESHES
@pytest.mark.parametrize("name", sorted(FLATTENING))
def test_flattening_an_uneven_batch_names_view_copies_and_padding(fix_state, mesh_shape, placements, name):
    x = torch.randn(3, 4, 6)
    mesh_dim = placements.index(Shard(0))
    with simulated_mesh(mesh_shape) as mesh:
        x_d = place_dtensor(x, mesh, placements)
        with pytest.raises(RuntimeError) as refused:
            FLATTENING[name](x_d, _weight(mesh))
    told = str(refused.value)
    if fix_state == "torch only":
        assert "view_copies" not in told
    else:
        assert "view_copies()" in told and "pad the batch from 3 to 4" in told, told
        assert f"dim 0 (size 3) is sharded unevenly over mesh dim {mesh_dim} (size 2)" in told, told


@MESHES
@pytest.mark.parametrize("name", sorted(FLATTENING))
def test_the_two_ways_out_named_in_the_error_both_work(mesh_shape, placements, name):
    """Inside view_copies() the same call matches one device; a padded batch of 4 views without a copy."""
    x = torch.randn(3, 4, 6)
    padded = torch.cat([x, torch.zeros(1, 4, 6)])
    expected = FLATTENING[name](x, WEIGHT)
    with simulated_mesh(mesh_shape) as mesh:
        with view_copies():
            got = FLATTENING[name](place_dtensor(x, mesh, placements), _weight(mesh)).full_tensor()
        padded_d = place_dtensor(padded, mesh, placements)
        viewed = FLATTENING[name](padded_d, _weight(mesh))
        assert all(torch.allclose(v, expected, atol=1e-6) for v in local_values(got).values())
        assert all(torch.allclose(v[: len(expected)], expected, atol=1e-6) for v in local_values(viewed.full_tensor()).values())
        if name == "view":  # the padded batch's view aliases the input shards
            assert all(
                viewed_piece.data_ptr() == piece.data_ptr()
                for piece, viewed_piece in zip(local_values(padded_d.to_local()).values(),
                                               local_values(viewed.to_local()).values())
            )


@pytest.mark.parametrize(
    "ranks, shape, placements, view, expected",
    [(2, (3, 4, 6), [Shard(1)], (3, 2, 2, 6), ("ok", (Shard(1),))),  # an even dim split: stays sharded
     (2, (3, 4, 6), [Shard(0)], (3, 24), ("ok", (Shard(0),))),  # the uneven dim not flattened: stays sharded
     (4, (4, 6), [Shard(0)], (2, 2, 6), ("refused", False))],  # an even dim split below the mesh size: refused
    ids=["even-split", "uneven-kept", "even-refused"],
)
def test_views_without_an_uneven_flattening_are_torch_own(fix_state, ranks, shape, placements, view, expected):
    x = torch.randn(shape)
    with simulated_mesh((ranks,)) as mesh:
        x_d = place_dtensor(x, mesh, placements)
        try:
            got = x_d.view(view)
        except RuntimeError as e:
            outcome = ("refused", "view_copies" in str(e))
        else:
            assert all(torch.equal(v, x.view(view)) for v in local_values(got.full_tensor()).values())
            outcome = ("ok", got.placements)
    assert outcome == expected


# a dim sharded on two mesh dims, even over the first and uneven at the inner split (global sizes pass torch's check)
NESTED = [
    ((2, 1, 2, 3), [Shard(2), Shard(2)], (2, 1, -1), "[6, 0, 6, 0] elements as [4, 2, 4, 2]"),
    ((6, 3), [Shard(0), Shard(0)], (-1,), "[6, 3, 6, 3] elements as [5, 4, 5, 4]"),
    ((6, 3), [Shard(0), Shard(0)], (2, 9), "[6, 3, 6, 3] elements as [9, 0, 9, 0]"),
]


@pytest.mark.parametrize("shape, placements, view, counts", NESTED, ids=["flatten-empty", "flatten", "split"])
def test_a_dim_split_unevenly_twice_over_is_refused_by_name_and_copied_inside(fix_state, shape, placements, view,
                                                                               counts):
    x = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    with simulated_mesh((2, 2)) as mesh:
        x_d = place_dtensor(x, mesh, placements)
        with pytest.raises(RuntimeError) as refused:
            x_d.view(view)
        if fix_state == "fixed":
            told = str(refused.value)
            assert "sharded on more than one mesh dim" in told and counts in told and "view_copies()" in told, told
        with view_copies():
            got = x_d.view(view)
        assert all(torch.equal(v, x.view(view)) for v in local_values(got.full_tensor()).values())


def test_a_dim_split_evenly_twice_over_is_viewed_in_place(fix_state):
    x = torch.arange(24.0).reshape(8, 3)
    with simulated_mesh((2, 2)) as mesh:
        x_d = place_dtensor(x, mesh, [Shard(0), Shard(0)])
        got = x_d.view(-1)
        assert got.placements == (Shard(0), Shard(0))
        assert all(torch.equal(v, x.view(-1)) for v in local_values(got.full_tensor()).values())
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(local_values(x_d.to_local()).values(),
                                                                 local_values(got.to_local()).values()))
