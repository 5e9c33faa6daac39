"""Proofs for pixel_shuffle / pixel_unshuffle: Partial passes, every dim shards where the chunks line up (and, for
pixel_unshuffle, no rank's piece is empty);
channel_shuffle: every dim but the channels shards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor_ext.rules import pixel_shuffle
from dtensor_ext._compat import Shard
from dtensor_ext.testing.checker import check_rule, sample_tensor
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


def _assert_proven_where_kept(op, shape, r, rule, chunks_align, mesh_shape):
    """Every combination the rule emits reassembles to the single-device result, or its layout is one that the
    rule's `layouts` filter drops (an output chunk not made of its own input chunk, or an empty unshuffle piece)."""
    report = check_rule(op, [sample_tensor(shape), r], mesh_shape=mesh_shape, rule=rule, search_missing=False)
    assert report.checked == report.rows ** len(mesh_shape)
    kept_but_wrong = [str(f) for f in report.failures if chunks_align(shape, r, mesh_shape, f.combination.inputs[0])]
    assert not kept_but_wrong


@PROVING_MESHES
@given(sample=shuffle_samples())
def test_pixel_shuffle_proven_where_its_chunks_align(mesh_shape, sample):
    batch, channels, height, width, r = sample
    _assert_proven_where_kept(aten.pixel_shuffle.default, (*batch, channels * r * r, height, width), r,
                              pixel_shuffle.pixel_shuffle_rule, pixel_shuffle.shuffled_chunks_align, mesh_shape)


@PROVING_MESHES
@given(sample=shuffle_samples())
def test_pixel_unshuffle_proven_where_its_chunks_align(mesh_shape, sample):
    batch, channels, height, width, r = sample
    _assert_proven_where_kept(aten.pixel_unshuffle.default, (*batch, channels, height * r, width * r), r,
                              pixel_shuffle.pixel_unshuffle_rule, pixel_shuffle.unshuffled_chunks_align, mesh_shape)


@pytest.mark.parametrize("mesh_shape, placements", [((4,), [Shard(2)]), ((2, 2), [Shard(2), Shard(3)]),
                                                    ((2, 2), [Shard(1), Shard(2)])])
def test_pixel_shuffle_keeps_aligned_chunks_and_moves_the_others(mesh_shape, placements):
    """C, H and W stay sharded with no collective where the chunks line up (what torch's decomposition does), for
    pixel_shuffle and pixel_unshuffle alike; where they do not (pixel_shuffle's H = 5 over 4 ranks, or 3 over 2,
    with r = 2; unshuffle's 10 and 6 rows), the input moves and the result is right."""
    from dtensor_ext.testing import local_values, place_dtensor
    from dtensor_ext.tools.comm_stats import CommStatsMode

    torch.manual_seed(0)
    aligned, misaligned = torch.randn(1, 16, 4, 4), torch.randn(1, 16, 5, 3)
    with simulated_mesh(mesh_shape) as mesh:
        for op, inverse, chunks_align in [
            (torch.pixel_shuffle, torch.pixel_unshuffle, pixel_shuffle.shuffled_chunks_align),
            (torch.pixel_unshuffle, torch.pixel_shuffle, pixel_shuffle.unshuffled_chunks_align),
        ]:
            x = aligned if op is torch.pixel_shuffle else inverse(aligned, 2)
            comm = CommStatsMode()
            with comm:
                out = op(place_dtensor(x, mesh, placements), 2)
            assert out.placements == tuple(placements) and not comm.stats.collectives, op
            assert all(v.equal(op(x, 2)) for v in local_values(out.full_tensor()).values())
            y = misaligned if op is torch.pixel_shuffle else inverse(misaligned, 2)
            assert not chunks_align(y.shape, 2, mesh_shape, placements)
            moved = op(place_dtensor(y, mesh, placements), 2)
            assert all(v.equal(op(y, 2)) for v in local_values(moved.full_tensor()).values())


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
