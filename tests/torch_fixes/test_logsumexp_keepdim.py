"""torch's logsumexp rule reads keepdim only from kwargs; torch.logsumexp(x, dim, True) passes it by position."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from tests.torch_fixes.sharded_runs import torch_alone_runs


def _run(x, placements, mesh_shape, *args, **kwargs):
    with simulated_mesh(mesh_shape) as mesh:
        with CommDebugMode() as comms:
            out = torch.logsumexp(place_dtensor(x, mesh, placements), *args, **kwargs)
        return out.placements, comms.get_comm_counts(), list(local_values(out.full_tensor()).values())


def test_positional_keepdim_on_a_kept_sharded_dim(fixed_ops, fix_state):
    """Where the feature check finds no defect, torch alone must be right."""
    x = torch.randn(4, 6)
    expected = torch.logsumexp(x, 0, True)
    fixed = "aten::logsumexp.default" in fixed_ops["logsumexp ignores positional keepdim"]
    if fix_state == "torch only" and fixed:  # placements computed for keepdim=False: a failing gather or a wrong layout
        try:
            placements, _, values = _run(x, [Shard(1)], (2,), 0, True)
        except RuntimeError:
            return
        assert placements != (Shard(1),) or not all(torch.allclose(v, expected, atol=1e-5) for v in values)
        return
    placements, _, values = _run(x, [Shard(1)], (2,), 0, True)
    assert placements == (Shard(1),)
    assert all(torch.allclose(v, expected, atol=1e-5) for v in values)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])
def test_every_layout_and_keepdim_spelling_is_right_and_keyword_cases_are_unchanged(mesh_shape):
    """Half of all layouts of a 5x3x2 input (uneven and empty shards, Partial), three dims, three spellings of
    keepdim: single-device values (torch gets keepdim=True wrong whenever a dim after the reduced one is sharded:
    the Python binding passes even `keepdim=True` by position); keepdim=False reaches torch's rule unchanged, so
    there the placements and collectives are torch's."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, 2)
    choices = [Replicate(), Partial(), Shard(0), Shard(1), Shard(2)]
    layouts = list(itertools.product(choices, repeat=len(mesh_shape)))[::2]
    cases = list(itertools.product(layouts, [0, 1, [0, 2]]))
    # keepdim=False under torch alone; None where it raised (e.g. gathering an empty shard on 2.13: not a case
    # torch got right)
    torch_results = torch_alone_runs(lambda case: _run(x, list(case[0]), mesh_shape, case[1], keepdim=False), cases)
    for (layout, dim), torch_result in zip(cases, torch_results):
        for call in [((dim, True), {}), ((dim,), {"keepdim": True}), ((dim, False), {})]:
            expected = torch.logsumexp(x, *call[0], **call[1])
            _, _, values = _run(x, list(layout), mesh_shape, *call[0], **call[1])
            assert all(torch.allclose(v, expected, atol=1e-5) for v in values), (layout, call)
        if torch_result is not None:
            assert _run(x, list(layout), mesh_shape, dim, keepdim=False)[:2] == torch_result[:2], layout


@pytest.mark.parametrize("placement", [Replicate(), Partial()], ids=str)
def test_zero_dim_input_is_replicated(placement):
    with simulated_mesh((2,)) as mesh:
        out = torch.logsumexp(place_dtensor(torch.tensor(1.5), mesh, [placement]), 0)
        assert out.placements == (Replicate(),)
        assert all(torch.allclose(v, torch.tensor(1.5)) for v in local_values(out.full_tensor()).values())
