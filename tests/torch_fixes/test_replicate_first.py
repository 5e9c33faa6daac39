"""expand of a sharded size-1 dim: torch raises, the fix replicates that dim (unbind along a sharded dim stays refused
as torch refuses it: tests/torch_fixes/test_torch_semantics_kept.py)."""

import pytest
import torch
from torch.distributed.tensor import Shard

from dtensor_ext.testing import place_dtensor, simulated_mesh
from tests.torch_fixes.sharded_runs import agrees, correct_runs_without_and_with_fixes, layouts

MESHES = pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])


EXPANDS = {
    "expand": lambda x: x.expand(5, 4, 3),
    "expand_new_dim": lambda x: x.expand(2, 5, 4, 3),
    "expand_copy": lambda x: torch.expand_copy(x, (5, 4, 3)),
    "broadcast_to": lambda x: torch.broadcast_to(x, (2, 5, 4, 3)),
}


@MESHES
@pytest.mark.parametrize("name", sorted(EXPANDS))
def test_expanding_a_sharded_size_one_dim_fails_in_torch_and_is_right_when_fixed(fixed_ops, fix_state, mesh_shape,
                                                                                 name):
    """x [5, 1, 3] with its size-1 dim sharded (whole on one rank, empty on the others), beside uneven and Partial
    placements on the other mesh dim. Where the feature check finds no defect, torch alone must be right."""
    expand = EXPANDS[name]
    # the op whose strategy runs (2.11 shards expand_copy through its decomposition into expand, right already)
    op = "aten::expand_copy.default" if name == "expand_copy" else "aten::expand.default"
    torch.manual_seed(0)
    x = torch.randn(5, 1, 3)
    expected = expand(x)
    sharded = [p for p in layouts(x, len(mesh_shape)) if Shard(1) in p]
    with simulated_mesh(mesh_shape) as mesh:
        for placements in sharded:
            x_d = place_dtensor(x, mesh, list(placements))
            if fix_state == "torch only" and op in fixed_ops["expand of a sharded size-1 dim"]:
                with pytest.raises(RuntimeError, match="^1\n"):  # the bare KeyError of the broadcast dim
                    expand(x_d)
                continue
            out = expand(x_d)
            assert agrees(out, expected), placements


@MESHES
def test_cases_torch_got_right_keep_their_placements_and_collectives(mesh_shape):
    torch.manual_seed(0)
    x, run = torch.randn(5, 1, 3), EXPANDS["expand"]
    torch_results, fixed_results = correct_runs_without_and_with_fixes(run, x, mesh_shape)
    assert len(torch_results) >= 3  # R, P and the shards of dims the op keeps
    assert {p: fixed_results.get(p) for p in torch_results} == torch_results
    assert len(fixed_results) == len(layouts(x, len(mesh_shape)))  # and every other layout now runs correctly
