"""linalg.solve_triangular sharded on batch dims: operands are sharded where they have the dim and whole where
they broadcast, so every layout gives the single-device solution; layouts torch got right keep their placements
and collectives."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext._compat import ShardingPlaceholder
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from dtensor_ext.torch_fixes.solve_triangular_batch import batch_rows
from tests.torch_fixes.sharded_runs import agrees

FIX = "solve_triangular batch broadcasting"
OP = "aten::linalg_solve_triangular.default"


def _triangular(*batch):
    torch.manual_seed(0)
    return torch.randn(*batch, 3, 3).triu() + 3 * torch.eye(3)


SHAPES = {  # A's batch, B's shape, left
    "same batch": ((4,), (4, 3, 2), True),
    "uneven batch": ((3,), (3, 3, 2), True),
    "A broadcasts": ((1,), (4, 3, 2), True),
    "B broadcasts": ((4,), (1, 3, 2), True),
    "B has fewer dims": ((4,), (3, 2), True),
    "A has more dims": ((2, 4), (4, 3, 2), True),
    "right side": ((4,), (4, 2, 3), False),
}


def _solve(a, b, left):
    return torch.linalg.solve_triangular(a, b, upper=True, left=left)


def _layouts(t, mesh_ndim, partial=False):
    one = [Replicate(), *(Shard(d) for d in range(t.ndim))] + ([Partial()] if partial else [])
    return list(itertools.product(one, repeat=mesh_ndim))


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_every_layout_of_both_operands_on_1d(case):
    a_batch, b_shape, left = SHAPES[case]
    a, b = _triangular(*a_batch), torch.randn(b_shape)
    expected = _solve(a, b, left)
    with simulated_mesh((4,)) as mesh:
        for pa, pb in itertools.product(_layouts(a, 1), _layouts(b, 1, partial=True)):
            got = _solve(place_dtensor(a, mesh, list(pa)), place_dtensor(b, mesh, list(pb)), left)
            assert agrees(got, expected, atol=1e-4), (pa, pb)


@pytest.mark.parametrize("case", ["same batch", "A has more dims", "B broadcasts"])
def test_every_layout_of_b_against_batch_sharded_a_on_2x2(case):
    a_batch, b_shape, left = SHAPES[case]
    a, b = _triangular(*a_batch), torch.randn(b_shape)
    expected = _solve(a, b, left)
    with simulated_mesh((2, 2)) as mesh:
        for pa in [(Replicate(), Shard(0)), (Shard(0), Replicate()), (Replicate(), Shard(1))]:
            for pb in _layouts(b, 2, partial=True):
                got = _solve(place_dtensor(a, mesh, list(pa)), place_dtensor(b, mesh, list(pb)), left)
                assert agrees(got, expected, atol=1e-4), (pa, pb)


def test_the_opinfo_sample_that_left_an_invalid_dtensor():
    """OpInfo sample 48 on 2x2: A [2, 3, 3] (R, S(1)), B [2, 3, 1] (S(1), S(0)); torch put A whole against B's
    batch shard, so each rank's output held the whole batch while claiming Shard(0)."""
    a, b = _triangular(2), torch.randn(2, 3, 1)
    with simulated_mesh((2, 2)) as mesh:
        got = _solve(place_dtensor(a, mesh, [Replicate(), Shard(1)]), place_dtensor(b, mesh, [Shard(1), Shard(0)]),
                     True)
        assert all(piece.shape == (1, 3, 1) for piece in local_values(got.to_local()).values())
        assert agrees(got, _solve(a, b, True), atol=1e-4)


def test_batch_rows_follow_broadcasting():
    def rows(a_shape, b_shape):  # placeholders compare by identity; their text says which dim
        return [" ".join(map(str, row)) for row in batch_rows(torch.Size(a_shape), torch.Size(b_shape))]

    s = [str(ShardingPlaceholder(d)) for d in range(2)]
    r = str(Replicate())
    assert rows([4, 3, 3], [4, 3, 2]) == [f"{s[0]} {s[0]} {s[0]}"]
    assert rows([1, 3, 3], [4, 3, 2]) == [f"{s[0]} {r} {s[0]}"]
    assert rows([4, 3, 3], [3, 2]) == [f"{s[0]} {s[0]} {r}"]
    assert rows([2, 4, 3, 3], [4, 3, 2]) == [f"{s[0]} {s[0]} {r}", f"{s[1]} {s[1]} {s[0]}"]
    assert rows([1, 3, 3], [1, 3, 2]) == []


def _runs(mesh_shape, a, b):
    """(layout of A, layout of B) -> (output placements, collective counts), or None where it failed or the
    output is not the single-device solution."""
    expected = _solve(a, b, True)
    seen = {}
    with simulated_mesh(mesh_shape) as mesh:
        for pa, pb in itertools.product(_layouts(a, len(mesh_shape)), _layouts(b, len(mesh_shape), partial=True)):
            try:
                with CommDebugMode() as comms:
                    got = _solve(place_dtensor(a, mesh, list(pa)), place_dtensor(b, mesh, list(pb)), True)
                right = agrees(got, expected, atol=1e-4)
            except RuntimeError:
                right = False
            seen[pa, pb] = (got.placements, comms.get_total_counts()) if right else None
    return seen


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_layouts_torch_got_right_keep_their_placements_and_collectives(mesh_shape):
    a, b = _triangular(4), torch.randn(4, 3, 2)
    try:
        dtensor_ext.install(fix_torch=False)
        torch_alone = _runs(mesh_shape, a, b)
    finally:
        dtensor_ext.install()
    fixed = _runs(mesh_shape, a, b)
    assert all(outcome is not None for outcome in fixed.values())
    kept = {k: v for k, v in torch_alone.items() if v is not None}
    assert kept and {k: fixed[k] for k in kept} == kept


def test_torch_alone_broadcasts_a_whole_a_where_the_check_finds_it(fixed_ops, torch_only):
    a, b = _triangular(4), torch.randn(4, 3, 2)
    with simulated_mesh((4,)) as mesh:
        try:
            right = agrees(_solve(place_dtensor(a, mesh, [Replicate()]), place_dtensor(b, mesh, [Shard(0)]), True),
                           _solve(a, b, True), atol=1e-4)
        except RuntimeError:
            right = False
    assert right == (OP not in fixed_ops[FIX])
