"""Proofs for pixel_shuffle / pixel_unshuffle: Partial passes, pixel_shuffle's batch dims shard, C/H/W stay whole;
channel_shuffle: every dim but the channels shards."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor_ext.rules import pixel_shuffle
from dtensor_ext.testing.checker import sample_tensor
from dtensor_ext.testing.mesh import simulated_mesh
from tests.rules.proof import PROVING_MESHES, assert_proven, assert_torch_validator_agrees

aten = torch.ops.aten


@st.composite
def shuffle_samples(draw):
    """(batch dims, channels, height, width, factor) for pixel_shuffle's input layout [*B, C*r*r, H, W]."""
    batch = draw(st.lists(st.integers(1, 5), max_size=2))
    factor = draw(st.integers(1, 3))
    channels, height, width = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    return batch, channels, height, width, factor


@PROVING_MESHES
@given(sample=shuffle_samples())
def test_pixel_shuffle_proven(mesh_shape, sample):
    batch, channels, height, width, r = sample
    x = sample_tensor((*batch, channels * r * r, height, width))
    assert_proven(aten.pixel_shuffle.default, [x, r], rule=pixel_shuffle.pixel_shuffle_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(sample=shuffle_samples())
def test_pixel_unshuffle_proven(mesh_shape, sample):
    batch, channels, height, width, r = sample
    x = sample_tensor((*batch, channels, height * r, width * r))
    assert_proven(aten.pixel_unshuffle.default, [x, r], rule=pixel_shuffle.pixel_unshuffle_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(spatial=st.lists(st.integers(1, 5), min_size=1, max_size=2), batch=st.integers(1, 5), data=st.data())
def test_channel_shuffle_proven(mesh_shape, spatial, batch, data):
    groups, per_group = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    op = data.draw(st.sampled_from([aten.channel_shuffle.default, aten.native_channel_shuffle.default]))
    x = sample_tensor((batch, groups * per_group, *spatial))
    assert_proven(op, [x, groups], rule=pixel_shuffle.channel_shuffle_rule, mesh_shape=mesh_shape)


def test_unshuffle_of_an_uneven_batch_is_right_and_shuffle_keeps_it_sharded():
    """pixel_unshuffle's kernel returns an empty input unchanged, so a batch that leaves a rank empty is gathered;
    pixel_shuffle's kernel handles empty inputs and keeps the uneven batch shard."""
    from torch.distributed.tensor import Shard

    from dtensor_ext.testing import local_values, place_dtensor

    torch.manual_seed(0)
    x, wide = torch.randn(5, 1, 6, 6), torch.randn(5, 9, 2, 2)
    with simulated_mesh((4,)) as mesh:
        out = torch.pixel_unshuffle(place_dtensor(x, mesh, [Shard(0)]), 3)
        assert all(v.equal(torch.pixel_unshuffle(x, 3)) for v in local_values(out.full_tensor()).values())
        kept = torch.pixel_shuffle(place_dtensor(wide, mesh, [Shard(0)]), 3)
        assert kept.placements == (Shard(0),)
        assert all(v.equal(torch.pixel_shuffle(wide, 3)) for v in local_values(kept.full_tensor()).values())


def test_torch_validator_finds_no_wrong_pixel_shuffle_rule():
    assert_torch_validator_agrees("nn.functional.pixel_shuffle")
    assert_torch_validator_agrees("nn.functional.pixel_unshuffle")
    assert_torch_validator_agrees("nn.functional.channel_shuffle")
