"""Proofs for the distance family: cdist and pdist, forward and backward, batch dims broadcast, several p."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor_ext.rules import distance
from dtensor_ext.testing.checker import sample_tensor
from tests.rules.proof import PROVING_MESHES, assert_proven, assert_torch_validator_agrees

aten = torch.ops.aten
NORMS = [0.0, 0.5, 1.0, 2.0, 3.0, float("inf")]


@st.composite
def cdist_samples(draw):
    """x1 [*B1, P, M], x2 [*B2, R, M] with B1, B2 broadcasting (either may drop or size-1 some batch dims)."""
    batch = draw(st.lists(st.integers(1, 3), max_size=2))
    kept = draw(st.integers(0, len(batch)))
    batch2 = [draw(st.sampled_from([1, b])) for b in batch[len(batch) - kept :]]
    rows1, rows2, features = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    shape1, shape2 = (*batch, rows1, features), (*batch2, rows2, features)
    if draw(st.booleans()):
        shape1, shape2 = shape2, shape1
    return shape1, shape2, draw(st.sampled_from(NORMS))


@PROVING_MESHES
@given(sample=cdist_samples())
def test_cdist_forward_proven(mesh_shape, sample):
    shape1, shape2, p = sample
    x1, x2 = sample_tensor(shape1), sample_tensor(shape2, seed=1)
    assert_proven(aten._cdist_forward.default, [x1, x2, p, None], rule=distance.cdist_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(sample=cdist_samples())
def test_cdist_backward_proven(mesh_shape, sample):
    """The backward takes the operands unexpanded; only an x1 already at the broadcast batch shape is sharded."""
    shape1, shape2, p = sample
    x1, x2 = sample_tensor(shape1), sample_tensor(shape2, seed=1)
    dist = aten._cdist_forward(x1, x2, p, None)
    grad = sample_tensor(dist.shape, seed=2)
    args = [grad, x1, x2, p, dist]
    assert_proven(aten._cdist_backward.default, args, rule=distance.cdist_backward_rule, mesh_shape=mesh_shape)


def test_torch_validator_finds_no_wrong_cdist_rule():
    assert_torch_validator_agrees("cdist")


@PROVING_MESHES
@given(shape=st.tuples(st.integers(1, 5), st.integers(1, 4)), p=st.sampled_from(NORMS))
def test_pdist_and_backward_proven(mesh_shape, shape, p):
    x = sample_tensor(shape)
    assert_proven(aten._pdist_forward.default, [x, p], rule=distance.pdist_rule, mesh_shape=mesh_shape)
    dist = aten._pdist_forward(x, p)
    grad = sample_tensor(dist.shape, seed=2)
    assert_proven(aten._pdist_backward.default, [grad, x, p, dist], rule=distance.pdist_backward_rule,
                  mesh_shape=mesh_shape)
