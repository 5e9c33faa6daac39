"""The pad fix: torch 2.11's `constant_pad_nd` strategy gives a one-placement output on a 2-D mesh."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh

PLACEMENTS = [Replicate(), Shard(0), Shard(1), Partial()]


def _pad_on_2x2(x, placements, value):
    with simulated_mesh((2, 2)) as mesh:
        y = F.pad(place_dtensor(x, mesh, list(placements)), (0, 1), value=value)
        return y.placements, list(local_values(y.full_tensor()).values())


def test_torch_alone_fails_where_the_check_finds_the_defect(fixed_ops, torch_only):
    """Where the check finds the defect torch alone must fail; elsewhere it must be right."""
    x = torch.randn(4, 6)
    fixed = "aten::constant_pad_nd.default" in fixed_ops["constant_pad_nd strategy is 1-D"]
    if fixed:
        with pytest.raises(IndexError):
            _pad_on_2x2(x, (Shard(0), Replicate()), 0.0)
    else:
        placements, values = _pad_on_2x2(x, (Shard(0), Replicate()), 0.0)
        assert len(placements) == 2 and all(torch.equal(v, F.pad(x, (0, 1))) for v in values)


@pytest.mark.parametrize("value", [0.0, -100.0], ids=["zero", "label_pad"])
def test_every_2x2_placement_pads_like_one_device(value):
    """Every pair of placements (the padded last dim sharded too, and Partial sums whose pieces a nonzero value
    would pad once per rank): a placement per mesh dim, the one-device result."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    expected = F.pad(x, (0, 1), value=value)
    for placements in [*itertools.product(PLACEMENTS, repeat=2), (Shard(0), Partial("max"))]:
        got_placements, values = _pad_on_2x2(x, placements, value)
        assert len(got_placements) == 2, placements
        assert all(torch.allclose(v, expected, atol=1e-5) for v in values), placements
        if placements == (Shard(0), Partial("max")):  # kept where exact: no gather
            assert got_placements == placements
