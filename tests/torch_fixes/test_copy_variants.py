"""squeeze_copy (ranks squeezed local size-1 shards) and unsafe_split (fallback lost the list output)."""

import pytest
import torch
from torch.distributed.tensor import Shard

from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from tests.torch_fixes.sharded_runs import agrees, correct_runs_without_and_with_fixes, fix_status, layouts

MESHES = pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])


def test_squeeze_copy_gives_ranks_different_ndims_in_torch(fixed_ops, torch_only):
    """[5, 1, 5, 1] sharded on dim 0 over 4 ranks: rank 2 holds one row, squeezes that dim too and returns 1-D
    (where the feature check finds the defect; elsewhere torch alone gives every rank 2-D and the right copy)."""
    x = torch.randn(5, 1, 5, 1)
    with simulated_mesh((4,)) as mesh:
        out = torch.squeeze_copy(place_dtensor(x, mesh, [Shard(0)]))
        local_ndims = {v.ndim for v in local_values(out).values()}
        if "aten::squeeze_copy.default" in fixed_ops["squeeze_copy squeezes local size-1 dims"]:
            assert out.shape == (5, 5) and local_ndims == {1, 2}
        else:
            assert local_ndims == {2} and agrees(out, torch.squeeze_copy(x))


SQUEEZES = {
    "all": lambda x: torch.squeeze_copy(x),
    "dim": lambda x: torch.squeeze_copy(x, 1),
    "dims": lambda x: torch.squeeze_copy(x, [1, 2, 3]),
}


@MESHES
@pytest.mark.parametrize("name", sorted(SQUEEZES))
def test_squeeze_copy_is_right_for_every_layout_when_fixed(mesh_shape, name):
    """Every layout of [5, 1, 5, 1] (uneven dim 0, sharded size-1 dims, Partial) gives the single-device copy."""
    squeeze = SQUEEZES[name]
    torch.manual_seed(0)
    x = torch.randn(5, 1, 5, 1)
    expected = squeeze(x)
    with simulated_mesh(mesh_shape) as mesh:
        for placements in layouts(x, len(mesh_shape)):
            out = squeeze(place_dtensor(x, mesh, list(placements)))
            assert {v.ndim for v in local_values(out).values()} == {expected.ndim}, placements
            assert agrees(out, expected), placements


# torch 2.14 shards unsafe_split itself (the fix reports "not needed"); there torch's own results must be right
UNSAFE_SPLIT_FIXED = fix_status("aten::unsafe_split.Tensor") == "fixed"
SPLITS = {  # name -> (split, the pieces are one piece: torch's fallback fails exactly there)
    "unsafe_split": (lambda x: torch.ops.aten.unsafe_split.Tensor(x, 2, 1), False),
    "unsafe_split_whole": (lambda x: torch.ops.aten.unsafe_split.Tensor(x, 5, 1), True),
    "unsafe_split_with_sizes": (lambda x: torch.ops.aten.unsafe_split_with_sizes.default(x, [1, 3, 1], 1), False),
    "unsafe_split_with_sizes_whole": (lambda x: torch.ops.aten.unsafe_split_with_sizes.default(x, [5], 1), True),
}


@MESHES
@pytest.mark.parametrize("name", sorted(SPLITS))
def test_unsafe_split_into_one_piece_fails_in_torch_and_every_split_is_right_when_fixed(fix_state, mesh_shape, name):
    split, one_piece = SPLITS[name]
    torch.manual_seed(0)
    x = torch.randn(5, 5)
    expected = split(x)
    with simulated_mesh(mesh_shape) as mesh:
        for placements in layouts(x, len(mesh_shape)):
            x_d = place_dtensor(x, mesh, list(placements))
            if fix_state == "torch only" and one_piece and UNSAFE_SPLIT_FIXED:
                with pytest.raises(RuntimeError, match="output_specs"):
                    split(x_d)
                continue
            outs = split(x_d)
            assert len(outs) == len(expected) and all(agrees(o, e) for o, e in zip(outs, expected)), placements


CASES_TORCH_RUNS = {
    "squeeze_copy": (torch.squeeze_copy, (4, 1, 6, 1)),
    "unsafe_split": (SPLITS["unsafe_split"][0], (5, 5)),
}


@MESHES
@pytest.mark.parametrize("case", sorted(CASES_TORCH_RUNS))
def test_cases_torch_got_right_keep_their_placements_or_lose_collectives(mesh_shape, case):
    """Where torch's fallback was right without collectives, the fix gives the same placements; where it
    communicated (it all-reduces a Partial input of squeeze_copy), the fix communicates no more."""
    run, shape = CASES_TORCH_RUNS[case]
    torch.manual_seed(0)
    torch_results, fixed_results = correct_runs_without_and_with_fixes(run, torch.randn(shape), mesh_shape)
    assert len(torch_results) >= 3
    for placements, (torch_out, torch_comms) in torch_results.items():
        fixed_out, fixed_comms = fixed_results[placements]
        assert fixed_comms <= torch_comms, placements
        if torch_comms == 0:
            assert fixed_out == torch_out, placements
