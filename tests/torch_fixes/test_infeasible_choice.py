"""Fallback to Replicate where torch's every candidate needs a Shard -> Partial move DTensor cannot make."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from tests.torch_fixes.sharded_runs import pair_runs_without_and_with_fixes

CROSSWISE = [[Shard(0), Partial()], [Partial(), Shard(0)], [Shard(0), Partial()]]


def _values(t) -> list[torch.Tensor]:
    return list(local_values(t.full_tensor()).values())


@pytest.mark.parametrize("dim", [0, 1])
def test_cat_of_crosswise_layouts_fails_in_torch_and_is_replicated_when_fixed(fixed_ops, fix_state, dim):
    """Where the feature check finds torch picking an impossible move (2.13), torch alone fails and the fix runs
    the cat replicated; where it does not (2.15 picks a move it can make), torch alone is right."""
    defect = bool(fixed_ops["impossible redistribution chosen"])
    torch.manual_seed(0)
    xs = [torch.randn(5, 3) for _ in CROSSWISE]
    expected = torch.cat(xs, dim)
    with simulated_mesh((2, 2)) as mesh:
        parts = [place_dtensor(x, mesh, p) for x, p in zip(xs, CROSSWISE)]
        if fix_state == "torch only" and defect:
            with pytest.raises(RuntimeError, match="to P\\(sum\\) not supported"):
                torch.cat(parts, dim)
            return
        out = torch.cat(parts, dim)
        if defect:
            assert out.placements == (Replicate(), Replicate())
        assert all(torch.allclose(v, expected, atol=1e-5) for v in _values(out))


def test_in_place_ops_keep_self_and_stay_right():
    """Replicating a copy of `self` would leave self's shards unchanged under a Replicate claim. With all fixes the
    in-place add runs (shard_to_partial makes the operand Partial) in self's placement; it must never be wrong."""
    torch.manual_seed(0)
    x, y = torch.randn(5), torch.randn(5)
    with simulated_mesh((2, 2)) as mesh:
        target = place_dtensor(x, mesh, [Partial(), Shard(0)])
        target.add_(place_dtensor(y, mesh, [Shard(0), Shard(0)]))
        assert target.placements == (Partial(), Shard(0))
        assert all(torch.allclose(v, x + y, atol=1e-5) for v in _values(target))


PLACEMENTS = [Replicate(), Shard(0), Shard(1), Partial()]


@pytest.mark.parametrize("op", [torch.cat, torch.add, torch.mul], ids=["cat", "add", "mul"])
def test_every_choice_torch_can_carry_out_is_unchanged(op):
    """All layouts of two 5x3 inputs on 2x2 (uneven shards, Partials): where torch runs at all, the fix gives the
    same output placement and the same collectives."""
    torch.manual_seed(0)
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    run = (lambda x, y: torch.cat([x, y])) if op is torch.cat else op
    expected = run(a, b)
    layouts = list(itertools.product(PLACEMENTS, repeat=2))
    pairs = list(itertools.product(layouts, layouts))[::3]  # a fixed third of the 256 pairs keeps this fast
    results = pair_runs_without_and_with_fixes(run, a, b, pairs, (2, 2), expected)
    ran_in_torch = [(pa, pb) for pa, pb in pairs if results[False, pa, pb] is not None]
    assert len(ran_in_torch) > 60
    for pa, pb in ran_in_torch:
        assert results[True, pa, pb] == results[False, pa, pb], (pa, pb)
