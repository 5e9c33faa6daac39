"""Batched solves (solve_triangular, lu_solve, ldl_solve) sharded on batch dims: operands are sharded where they
have the dim and whole where they broadcast, so every layout gives the single-device solution; layouts torch got
right keep their placements and collectives."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext._compat import ShardingPlaceholder
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from dtensor_ext.torch_fixes.batched_solves import batch_rows
from tests.torch_fixes.sharded_runs import agrees, refused_without_a_strategy, torch_shards

FIX = "batched solves broadcasting"
OP = "aten::linalg_solve_triangular.default"


def _triangular(*batch):
    torch.manual_seed(0)
    return torch.randn(*batch, 3, 3).triu() + 3 * torch.eye(3)


SHAPES = {  # A's batch, B's shape, left
    "same batch": ((4,), (4, 3, 2), True),
    "uneven batch": ((3,), (3, 3, 2), True),
    "A broadcasts": ((1,), (4, 3, 2), True),
    "B broadcasts": ((4,), (1, 3, 2), True),
    "one matrix each": ((1,), (1, 3, 2), True),
    "B has fewer dims": ((4,), (3, 2), True),
    "A has more dims": ((2, 4), (4, 3, 2), True),
    "right side": ((4,), (4, 2, 3), False),
}


def _solve(a, b, left):
    return torch.linalg.solve_triangular(a, b, upper=True, left=left)


# torch 2.11 has no strategy for the linalg solves at all (nor does the package): they fail on DTensors there, with
# or without the fix, and the tests check that they say so
SOLVES_SHARDED = torch_shards(torch.ops.aten.linalg_solve_triangular.default)


def _checked_solve(a, b, left, expected) -> None:
    """The sharded solve gives the single-device solution; where torch has no strategy for it (2.11), it says so."""
    if not SOLVES_SHARDED:
        return refused_without_a_strategy(torch.ops.aten.linalg_solve_triangular.default, lambda: _solve(a, b, left))
    assert agrees(_solve(a, b, left), expected, atol=1e-4)


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
            _checked_solve(place_dtensor(a, mesh, list(pa)), place_dtensor(b, mesh, list(pb)), left, expected)


@pytest.mark.parametrize("case", ["same batch", "A has more dims", "B broadcasts"])
def test_every_layout_of_b_against_batch_sharded_a_on_2x2(case):
    a_batch, b_shape, left = SHAPES[case]
    a, b = _triangular(*a_batch), torch.randn(b_shape)
    expected = _solve(a, b, left)
    with simulated_mesh((2, 2)) as mesh:
        for pa in [(Replicate(), Shard(0)), (Shard(0), Replicate()), (Replicate(), Shard(1))]:
            for pb in _layouts(b, 2, partial=True):
                _checked_solve(place_dtensor(a, mesh, list(pa)), place_dtensor(b, mesh, list(pb)), left, expected)


def test_the_opinfo_sample_that_left_an_invalid_dtensor():
    """OpInfo sample 48 on 2x2: A [2, 3, 3] (R, S(1)), B [2, 3, 1] (S(1), S(0)); torch put A whole against B's
    batch shard, so each rank's output held the whole batch while claiming Shard(0)."""
    a, b = _triangular(2), torch.randn(2, 3, 1)
    with simulated_mesh((2, 2)) as mesh:
        if not SOLVES_SHARDED:
            return _checked_solve(place_dtensor(a, mesh, [Replicate(), Shard(1)]),
                                  place_dtensor(b, mesh, [Shard(1), Shard(0)]), True, None)
        got = _solve(place_dtensor(a, mesh, [Replicate(), Shard(1)]), place_dtensor(b, mesh, [Shard(1), Shard(0)]),
                     True)
        assert all(piece.shape == (1, 3, 1) for piece in local_values(got.to_local()).values())
        assert agrees(got, _solve(a, b, True), atol=1e-4)


def test_batch_rows_follow_broadcasting():
    def rows(*operands):  # placeholders compare by identity; their text says which dim
        return [" ".join(map(str, row)) for row in batch_rows([(torch.Size(s), core) for s, core in operands])]

    s = [str(ShardingPlaceholder(d)) for d in range(2)]
    r = str(Replicate())
    assert rows(([4, 3, 3], 2), ([4, 3, 2], 2)) == [f"{s[0]} {s[0]} {s[0]}"]
    assert rows(([1, 3, 3], 2), ([4, 3, 2], 2)) == [f"{s[0]} {r} {s[0]}"]
    assert rows(([4, 3, 3], 2), ([3, 2], 2)) == [f"{s[0]} {s[0]} {r}"]
    assert rows(([2, 4, 3, 3], 2), ([4, 3, 2], 2)) == [f"{s[0]} {s[0]} {r}", f"{s[1]} {s[1]} {s[0]}"]
    assert rows(([1, 3, 3], 2), ([1, 3, 2], 2)) == [f"{s[0]} {s[0]} {s[0]}"]  # size 1 everywhere: sharded alike
    assert rows(([3, 3], 2), ([3, 2], 2)) == []
    assert rows(([2, 5, 5], 2), ([2, 5], 1), ([5, 5], 2)) == [f"{s[0]} {s[0]} {s[0]} {r}"]


FACTORED = {  # factorization's batch, B's shape, keywords
    "same batch": ((4,), (4, 3, 2), {}),
    "uneven batch": ((3,), (3, 3, 2), {}),
    "B without batch": ((4,), (3, 2), {}),
    "factorization broadcasts": ((1,), (4, 3, 2), {}),
    "B has more dims": ((4,), (2, 4, 3, 2), {}),
}


def _spd(*batch):
    torch.manual_seed(0)
    a = torch.randn(*batch, 3, 3, dtype=torch.float64)
    return a @ a.mT + 3 * torch.eye(3, dtype=torch.float64)


# ldl_solve broadcasts only a B without batch dims: with a factorization batch of 1 against B's 4, or B with more
# batch dims, the CPU kernel itself crashes (segfault on one device, torch 2.13), so those cases are lu_solve's
SOLVES = [(solver, case) for solver in ("lu_solve", "ldl_solve") for case in sorted(FACTORED)
          if solver == "lu_solve" or case in ("same batch", "uneven batch", "B without batch")]


@pytest.mark.parametrize("solver, case", SOLVES)
def test_factored_solves_in_every_batch_layout_on_1d(solver, case):
    batch, b_shape, kwargs = FACTORED[case]
    factor = torch.linalg.lu_factor if solver == "lu_solve" else torch.linalg.ldl_factor
    solve = getattr(torch.linalg, solver)
    factors, pivots = factor(_spd(*batch))
    b = torch.randn(b_shape, dtype=torch.float64)
    expected = solve(factors, pivots, b, **kwargs)
    op = getattr(torch.ops.aten, f"linalg_{solver}").default
    with simulated_mesh((4,)) as mesh:
        for pf, pb in itertools.product(_layouts(factors, 1), _layouts(b, 1, partial=True)):
            pp = pf if pf[0] in (Replicate(), Shard(0)) and pivots.ndim > 1 else (Replicate(),)
            args = (place_dtensor(factors, mesh, list(pf)), place_dtensor(pivots, mesh, list(pp)),
                    place_dtensor(b, mesh, list(pb)))
            if not torch_shards(op):
                refused_without_a_strategy(op, lambda: solve(*args, **kwargs))
                continue
            assert agrees(solve(*args, **kwargs), expected, atol=1e-8), (pf, pp, pb)


def _ldl_sample(mesh):
    """OpInfo sample 4 on 2x2: LD [2, 5, 5], pivots [2, 5], B [5, 5]; torch's rule sharded B's dim 0 (its rows)
    along with LD's batch. Returns (sharded call, single-device solution)."""
    torch.manual_seed(0)
    a = torch.randn(2, 5, 5, dtype=torch.float64)
    ld, pivots = torch.linalg.ldl_factor(a @ a.mT + 5 * torch.eye(5, dtype=torch.float64))
    b = torch.randn(5, 5, dtype=torch.float64)
    args = (place_dtensor(ld, mesh, [Replicate(), Shard(2)]), place_dtensor(pivots, mesh, [Shard(1), Shard(1)]),
            place_dtensor(b, mesh, [Replicate(), Shard(0)]))
    return (lambda: torch.linalg.ldl_solve(*args)), torch.linalg.ldl_solve(ld, pivots, b)


def test_the_ldl_solve_sample_that_sharded_matrix_rows_on_2x2():
    with simulated_mesh((2, 2)) as mesh:
        solve, expected = _ldl_sample(mesh)
        if not torch_shards(torch.ops.aten.linalg_ldl_solve.default):
            return refused_without_a_strategy(torch.ops.aten.linalg_ldl_solve.default, solve)
        assert agrees(solve(), expected, atol=1e-8)


def test_torch_alone_shards_the_rows_of_a_b_without_batch_where_the_check_finds_it(fixed_ops, torch_only):
    with simulated_mesh((2, 2)) as mesh:
        solve, expected = _ldl_sample(mesh)
        try:
            right = agrees(solve(), expected, atol=1e-8)
        except RuntimeError:
            right = False
    # without a torch strategy (2.11) the solve fails, and there is nothing to fix
    assert right == ("aten::linalg_ldl_solve.default" not in fixed_ops[FIX]) if SOLVES_SHARDED else not (
        right or fixed_ops[FIX])


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
    if not SOLVES_SHARDED:
        with simulated_mesh(mesh_shape) as mesh:
            return _checked_solve(place_dtensor(a, mesh, [Shard(0)] * len(mesh_shape)),
                                  place_dtensor(b, mesh, [Shard(0)] * len(mesh_shape)), True, None)
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
    assert right == (OP not in fixed_ops[FIX]) if SOLVES_SHARDED else not (right or fixed_ops[FIX])
