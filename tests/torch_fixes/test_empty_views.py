"""Views of empty tensors: torch refuses identity views of a sharded size-0 dim and hangs on some others."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from tests.torch_fixes.sharded_runs import layouts

MESHES = pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])


def _is(t, expected) -> bool:
    return all(v.shape == expected.shape for v in local_values(t.full_tensor()).values())


FIX = "views of empty tensors"
VIEWS = {
    "view": lambda x: x.view(-1, 4),
    "reshape": lambda x: x.reshape(0, 4),
    "view_as": lambda x: x.view_as(torch.empty(0, 4)),
}


@MESHES
@pytest.mark.parametrize("name", sorted(VIEWS))
def test_identity_view_of_a_sharded_empty_dim_fails_in_torch_and_keeps_placements_when_fixed(fixed_ops, fix_state,
                                                                                             mesh_shape, name):
    """[0, 4] (F.bilinear's empty batch) viewed as itself: no element moves and every placement survives (torch
    alone refuses a sharded dim 0 where the feature check finds the defect, and keeps the placements elsewhere)."""
    view = VIEWS[name]
    refused = "aten::view.default" in fixed_ops[FIX]  # all three reach DTensor as aten.view
    x = torch.zeros(0, 4)
    with simulated_mesh(mesh_shape) as mesh:
        for placements in layouts(x, len(mesh_shape)):
            x_d = place_dtensor(x, mesh, list(placements))
            if fix_state == "torch only" and refused:
                if Shard(0) in placements:
                    try:
                        out = view(x_d)
                    except RuntimeError as refusal:
                        assert "remove or reshape sharded dimension 0" in str(refusal)
                    else:  # 2.11 replicates the empty tensor instead of refusing
                        assert Shard(0) not in out.placements and _is(out, view(x))
                continue
            with CommDebugMode() as comms:
                out = view(x_d)
            assert out.placements == placements and comms.get_total_counts() == 0
            assert _is(out, view(x))


def test_torch_view_groups_loses_size_zero_dims_where_the_check_finds_it(fixed_ops, torch_only):
    """The hang itself is not run under torch: its cause, the dim mapping that drops a size-0 dim, is checked; the
    fix is applied exactly where it drops it."""
    assert bool(fixed_ops[FIX]) == _compat.view_groups_drops_empty_dims()
    if not fixed_ops[FIX]:  # torch alone: the identity view of a sharded empty dim keeps its placement
        with simulated_mesh((4,)) as mesh:
            out = place_dtensor(torch.zeros(0, 4), mesh, [Shard(0)]).view(0, 4)
            assert out.placements == (Shard(0),) and _is(out, torch.zeros(0, 4))


@MESHES
def test_view_torch_never_returns_from_is_replicated_when_fixed(mesh_shape):
    x = torch.zeros(3, 0)
    with simulated_mesh(mesh_shape) as mesh:
        for placements in layouts(x, len(mesh_shape)):
            out = place_dtensor(x, mesh, list(placements)).view(0, 3)
            assert out.placements == (Replicate(),) * len(mesh_shape) and _is(out, torch.zeros(0, 3))


@MESHES
def test_views_of_tensors_with_elements_are_left_to_torch(mesh_shape):
    """Same placements, collectives and values (or the same refusal) with and without the fix."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    views = [lambda t: t.view(24), lambda t: t.view(2, 2, 6), lambda t: t.reshape(4, 3, 2), lambda t: t.view(6, 4)]

    def outcomes():
        seen = []
        with simulated_mesh(mesh_shape) as mesh:
            for view, placements in itertools.product(views, layouts(x, len(mesh_shape))):
                try:
                    with CommDebugMode() as comms:
                        out = view(place_dtensor(x, mesh, list(placements)))
                except RuntimeError as e:  # torch's own refusal (the uneven-views fix adds advice before it)
                    seen.append(str(e).split(" torch: ", 1)[-1].splitlines()[0])
                    continue
                values = local_values(out.full_tensor())
                seen.append((out.placements, dict(comms.get_comm_counts()), all(v.equal(view(x)) for v in values.values())))
        return seen

    try:
        dtensor_ext.install(fix_torch=False)
        torch_outcomes = outcomes()
        dtensor_ext.install()
        fixed_outcomes = outcomes()
    finally:
        dtensor_ext.install()
    # where torch promised shards that hold other element counts than they view (a dim sharded twice over) its
    # kernel failed; the uneven-views fix refuses those by name instead
    kernel_failures = [i for i, o in enumerate(torch_outcomes) if isinstance(o, str) and "is invalid for input" in o]
    assert all("sharded on more than one mesh dim" in fixed_outcomes[i] for i in kernel_failures)
    assert len(kernel_failures) == (2 if mesh_shape == (2, 2) else 0)
    assert [o for i, o in enumerate(fixed_outcomes) if i not in kernel_failures] == [
        o for i, o in enumerate(torch_outcomes) if i not in kernel_failures]
