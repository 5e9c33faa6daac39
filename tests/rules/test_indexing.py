"""Proofs of the indexing/scatter rules: every row the rules emit reproduces the single-device result on 1-D, 2-D
and 3-D meshes, for hypothesis-drawn shapes (uneven and empty shards) and in-range index tensors; torch's own
validator agrees; real DTensor programs match single-device runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor_ext.rules import indexing
from dtensor_ext.testing import MESH_SHAPES, check_rule, simulated_mesh
from dtensor_ext.testing.strategies import dims

aten = torch.ops.aten
MESHES = list(MESH_SHAPES.values())
# 3-D meshes expand a dozen rows to ~1700 combinations; an evenly spaced subset keeps CI fast (2-D checks all).
MAX_COMBINATIONS = 48


def prove(op, rule, args, kwargs=None, mesh_shape=(2,)):
    """Every (sampled) combination of the rule's rows is right; the search for missing rows runs in the 1-D
    exploration script, not here (it tries every placement of every input)."""
    report = check_rule(op, args, kwargs or {}, mesh_shape=mesh_shape, rule=rule, search_missing=False,
                        max_combinations=MAX_COMBINATIONS)
    report.assert_ok()
    return report


def floats(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def indices(high, shape, seed):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


@st.composite
def destination_and_dim(draw, max_dims=3):
    """A destination shape (some dims may be empty), and a dim to index whose size is at least 1."""
    shape = list(draw(st.lists(dims(min_size=0), min_size=1, max_size=max_dims)))
    dim = draw(st.integers(0, len(shape) - 1))
    shape[dim] = max(shape[dim], 1)
    return shape, dim


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(data=st.data())
def test_index_add(mesh_shape, data):
    shape, dim = data.draw(destination_and_dim())
    n = data.draw(dims())
    source_shape = [*shape[:dim], n, *shape[dim + 1 :]]
    alpha = data.draw(st.sampled_from([1, -2.5]))
    args = [floats(shape, 0), dim, indices(shape[dim], (n,), 1), floats(source_shape, 2)]
    prove(aten.index_add.default, indexing.index_add_rule, args, {"alpha": alpha}, mesh_shape)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(data=st.data())
def test_index_copy(mesh_shape, data):
    shape, dim = data.draw(destination_and_dim())
    n = data.draw(st.integers(1, shape[dim]))
    source_shape = [*shape[:dim], n, *shape[dim + 1 :]]
    index = torch.randperm(shape[dim], generator=torch.Generator().manual_seed(3))[:n]
    prove(aten.index_copy.default, indexing.index_copy_rule, [floats(shape, 0), dim, index, floats(source_shape, 2)],
          mesh_shape=mesh_shape)


@st.composite
def scatter_operands(draw):
    shape, dim = draw(destination_and_dim())
    index_shape = [draw(st.integers(0, s)) if d != dim else draw(dims(min_size=0)) for d, s in enumerate(shape)]
    if draw(st.booleans()):  # index spanning self on every other dim, so those dims can be sharded
        index_shape = [s if d != dim else index_shape[d] for d, s in enumerate(shape)]
    src_shape = [max(i, draw(st.integers(i, i + 1))) for i in index_shape]
    return [floats(shape, 0), dim, indices(shape[dim], tuple(index_shape), 1), floats(src_shape, 2)]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(operands=scatter_operands(), reduce=st.sampled_from(["sum", "prod", "mean", "amax", "amin"]),
       include_self=st.booleans())
def test_scatter_reduce(mesh_shape, operands, reduce, include_self):
    prove(aten.scatter_reduce.two, indexing.scatter_reduce_rule, [*operands, reduce], {"include_self": include_self},
          mesh_shape)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(operands=scatter_operands(), reduce=st.sampled_from(["add", "multiply"]))
def test_scatter_legacy_reduce(mesh_shape, operands, reduce):
    prove(aten.scatter.reduce, indexing.scatter_legacy_reduce_rule, operands, {"reduce": reduce}, mesh_shape)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(shape=st.lists(dims(min_size=0), min_size=1, max_size=3), extra=st.integers(0, 3))
def test_masked_scatter(mesh_shape, shape, extra):
    mask = indices(2, tuple(shape), 1).bool()
    source = floats((int(mask.sum()) + extra,), 2)
    prove(aten.masked_scatter.default, indexing.masked_scatter_rule, [floats(shape, 0), mask, source],
          mesh_shape=mesh_shape)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(shape=st.lists(dims(), min_size=1, max_size=3), index_shape=st.lists(dims(min_size=0), max_size=2))
def test_take(mesh_shape, shape, index_shape):
    self = floats(shape, 0)
    prove(aten.take.default, indexing.take_rule, [self, indices(self.numel(), tuple(index_shape), 1)],
          mesh_shape=mesh_shape)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(shape=st.lists(dims(), min_size=1, max_size=3), index_shape=st.lists(dims(min_size=0), max_size=2),
       accumulate=st.booleans())
def test_put(mesh_shape, shape, index_shape, accumulate):
    self = floats(shape, 0)
    index = indices(self.numel(), tuple(index_shape), 1)
    if not accumulate:  # put without accumulate leaves duplicate indices undefined: draw distinct ones
        index = torch.randperm(self.numel(), generator=torch.Generator().manual_seed(1))[: index.numel()]
    source = floats(tuple(index.shape), 2)
    prove(aten.put.default, indexing.put_rule, [self, index, source, accumulate], mesh_shape=mesh_shape)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(batch=st.lists(dims(min_size=0), max_size=2), length=dims(), values=dims(min_size=0),
       one_sequence=st.booleans(), right=st.booleans(), with_sorter=st.booleans())
def test_searchsorted(mesh_shape, batch, length, values, one_sequence, right, with_sorter):
    seq_shape = (length,) if one_sequence else (*batch, length)
    unsorted = floats(seq_shape, 0)
    seq = unsorted if with_sorter else unsorted.sort(-1).values
    kwargs = {"right": right}
    if with_sorter:
        kwargs["sorter"] = unsorted.argsort(-1)
    prove(aten.searchsorted.Tensor, indexing.searchsorted_rule, [seq, floats((*batch, values), 1)], kwargs,
          mesh_shape)
