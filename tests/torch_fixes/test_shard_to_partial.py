"""Shard -> Partial moves asked for by a strategy run as Shard -> Replicate -> Partial."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from dtensor_ext._compat import fake_tensor_mode, shard_to_partial_sum_supported
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from tests.torch_fixes.sharded_runs import pair_runs_without_and_with_fixes


def _values(t) -> list[torch.Tensor]:
    return list(local_values(t.full_tensor()).values())


@pytest.mark.parametrize("operand", [[Shard(0), Shard(0)], [Shard(0), Replicate()]], ids=str)
def test_in_place_add_to_a_partial_with_a_sharded_operand(fix_state, operand):
    torch.manual_seed(0)
    x, y = torch.randn(5), torch.randn(5)
    with simulated_mesh((2, 2)) as mesh:
        target = place_dtensor(x, mesh, [Partial(), Shard(0)])
        other = place_dtensor(y, mesh, operand)
        if fix_state == "torch only" and not shard_to_partial_sum_supported():
            with pytest.raises(RuntimeError, match="to P\\(sum\\) not supported yet"):
                target.add_(other)
            return
        target.add_(other)  # (torch 2.14 makes the move itself)
        assert target.placements == (Partial(), Shard(0))
        assert all(torch.allclose(v, x + y, atol=1e-5) for v in _values(target))


def test_poisson_nll_loss_on_crosswise_layouts(fix_state):
    torch.manual_seed(0)
    x, t = torch.randn(5), torch.rand(5)
    expected = torch.nn.functional.poisson_nll_loss(x, t, full=True, reduction="none")
    with simulated_mesh((2, 2)) as mesh:
        args = place_dtensor(x, mesh, [Partial(), Shard(0)]), place_dtensor(t, mesh, [Shard(0), Shard(0)])
        if fix_state == "torch only" and not shard_to_partial_sum_supported():
            # torch alone refuses where its choice needs the Shard -> Partial move (2.12, 2.13); a torch choosing a
            # layout without it (2.11) must be right
            try:
                out = torch.nn.functional.poisson_nll_loss(*args, full=True, reduction="none")
            except RuntimeError as refusal:
                assert "not supported yet" in str(refusal)
                return
        else:
            out = torch.nn.functional.poisson_nll_loss(*args, full=True, reduction="none")
        assert all(torch.allclose(v, expected, atol=1e-5) for v in _values(out))


def test_moves_torch_makes_are_unchanged():
    """In-place adds over a fixed sample of layouts torch can run: same placement and collectives with the fix."""
    torch.manual_seed(0)
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    choices = [Replicate(), Shard(0), Shard(1), Partial()]
    layouts = list(itertools.product(itertools.product(choices, repeat=2), repeat=2))[::5]

    def add_in_place(target, other):
        return target.add_(other)

    results = pair_runs_without_and_with_fixes(add_in_place, x, y, layouts, (2, 2), x + y)
    ran = [(pa, pb) for pa, pb in layouts if results[False, pa, pb] is not None]
    assert len(ran) > 20
    for pa, pb in ran:
        assert results[True, pa, pb] == results[False, pa, pb], (pa, pb)


def test_the_feature_check_is_the_same_inside_a_fake_run():
    """The first Shard -> Partial move can come from inside a fake run (a policy proof): the check then ran on fake
    tensors, its verdict was cached, and torch 2.15, which makes the move itself, was taken to refuse it (every later
    Shard -> Partial(sum) went through an all-gather)."""
    outside = shard_to_partial_sum_supported()
    shard_to_partial_sum_supported.cache_clear()
    try:
        with fake_tensor_mode():
            inside = shard_to_partial_sum_supported()
    finally:
        shard_to_partial_sum_supported.cache_clear()
    assert inside == outside
