"""Proofs of the indexing/scatter rules: every row the rules emit reproduces the single-device result on 1-D, 2-D
and 3-D meshes, for hypothesis-drawn shapes (uneven and empty shards) and in-range index tensors; torch's own
validator agrees; real DTensor programs match single-device runs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dtensor_ext.rules import indexing
from dtensor_ext.testing import MESH_SHAPES, check_rule, place_dtensor, simulated_mesh
from dtensor_ext.testing.strategies import dims
from tests.rules.proof import NEEDS_TORCH_VALIDATOR

aten = torch.ops.aten
MESHES = list(MESH_SHAPES.values())
# 3-D meshes expand a dozen rows to ~1700 combinations; an evenly spaced subset keeps CI fast (2-D checks all).
MAX_COMBINATIONS = 48


def prove(op, rule, args, kwargs=None, mesh_shape=(2,)):
    """Every (sampled) combination of the rule's rows is right; the search for missing rows runs in the 1-D
    exploration script, not here (it tries every placement of every input)."""
    report = check_rule(op, args, kwargs or {}, mesh_shape=mesh_shape, rule=rule, search_missing=False,
                        max_combinations=MAX_COMBINATIONS if len(mesh_shape) > 2 else None)
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
@given(operands=scatter_operands(), reduce=st.sampled_from(["add", "multiply"]),
       value=st.sampled_from([-1.5, 0.5, 3.0]))
def test_scatter_value_reduce(mesh_shape, operands, reduce, value):
    self, dim, index, _ = operands
    prove(aten.scatter.value_reduce, indexing.scatter_value_reduce_rule, [self, dim, index, value], {"reduce": reduce},
          mesh_shape)


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


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(length=dims(), right=st.booleans(), with_sorter=st.booleans())
def test_searchsorted_of_one_value(mesh_shape, length, right, with_sorter):
    unsorted = floats((length,), 0)
    seq = unsorted if with_sorter else unsorted.sort(-1).values
    kwargs = {"right": right}
    if with_sorter:
        kwargs["sorter"] = unsorted.argsort(-1)
    prove(aten.searchsorted.Scalar, indexing.searchsorted_scalar_rule, [seq, 0.25], kwargs, mesh_shape)


@st.composite
def masked_index_operands(draw, even_multiple=1):
    """self, mask and an indices list (None on dims not indexed) whose tensors broadcast together; the mask
    broadcasts against the result. Dims of self that no index touches are multiples of `even_multiple`."""
    shape = draw(st.lists(dims(), min_size=1, max_size=3))
    indexed = draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)).filter(any))
    shape = [s if indexed[d] else s * even_multiple for d, s in enumerate(shape)]
    broadcast = draw(st.lists(dims(min_size=0), min_size=1, max_size=2))
    index_list = []
    for d, size in enumerate(shape):
        if not indexed[d]:
            index_list.append(None)
            continue
        own = [b if draw(st.booleans()) else 1 for b in broadcast]
        index_list.append(indices(size, tuple(own), d))
    while index_list[-1] is None:  # trailing Nones are not part of the op's indices list
        index_list.pop()
    self = floats(shape, 0)
    result_shape = self[tuple(slice(None) if i is None else i for i in index_list)].shape
    mask_shape = [s if draw(st.booleans()) else 1 for s in result_shape][draw(st.integers(0, len(result_shape))):]
    return self, indices(2, tuple(mask_shape), 9).bool(), index_list, result_shape


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(data=st.data(), fill=st.sampled_from([0.0, -1.5]))
def test_unsafe_masked_index(mesh_shape, data, fill):
    """The rule asks for even shards of self (an empty self gives a wrongly shaped result): self's unindexed
    dims are drawn as multiples of the mesh size; the index dims stay uneven."""
    self, mask, index_list, _ = data.draw(masked_index_operands(even_multiple=math.prod(mesh_shape)))
    prove(aten._unsafe_masked_index.default, indexing.unsafe_masked_index_rule, [self, mask, index_list, fill],
          mesh_shape=mesh_shape)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(operands=masked_index_operands())
def test_unsafe_masked_index_put_accumulate(mesh_shape, operands):
    self, mask, index_list, result_shape = operands
    prove(aten._unsafe_masked_index_put_accumulate.default, indexing.unsafe_masked_index_put_accumulate_rule,
          [self, mask, index_list, floats(result_shape, 3)], mesh_shape=mesh_shape)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(rows=dims(), width=dims(min_size=0), bag_sizes=st.lists(st.integers(0, 4), min_size=1, max_size=4),
       mode=st.sampled_from([0, 1, 2]), weighted=st.booleans(), forward_only=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_embedding_bag(mesh_shape, rows, width, bag_sizes, mode, weighted, forward_only, dtype):
    n = sum(bag_sizes)
    offsets = torch.tensor([0, *bag_sizes[:-1]]).cumsum(0)
    weights = floats((n,), 4).to(dtype) if weighted and mode == 0 else None  # per-sample weights need mode="sum"
    op = aten._embedding_bag_forward_only.default if forward_only else aten._embedding_bag.default
    args = [floats((rows, width), 0).to(dtype), indices(rows, (n,), 1), offsets, False, mode, False, weights]
    prove(op, indexing.embedding_bag_rule, args, mesh_shape=mesh_shape)


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_embedding_bag_float32_table_with_an_empty_column_shard(mode):
    """The OpInfo case the proofs missed: 5 float32 columns on 4 ranks leave rank 3 none, and the CPU kernel
    raises on a column-less table in sum/mean mode (two bags) - but only on its multi-threaded path, and the rule
    tests run single-threaded (tests/conftest.py), with float64 tables, which never take that path."""
    table = floats((10, 5), 0).float()
    weights = floats((5,), 4).float() if mode == 0 else None
    args = [table, torch.tensor([5, 1, 6, 5, 6]), torch.tensor([0, 3]), False, mode, False, weights]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prove(aten._embedding_bag.default, indexing.embedding_bag_rule, args, mesh_shape=(4,))
    finally:
        torch.set_num_threads(threads)


# OpInfo names whose samples reach the ops above as single aten calls.
VALIDATED_OPINFOS = ["index_add", "index_copy", "scatter_reduce", "scatter", "masked_scatter", "take", "put",
                     "_unsafe_masked_index", "_unsafe_masked_index_put_accumulate"]


@pytest.mark.parametrize("name", VALIDATED_OPINFOS)
@NEEDS_TORCH_VALIDATOR
def test_torch_validator_finds_no_wrong_rule(mesh_1d2, name):
    from dtensor_ext._compat import compare_operator

    stats = compare_operator(name, world_size=2, max_samples=4, incorrect_only=True, dtype=torch.float64)
    assert stats.true_positives > 0, f"{name}: the validator checked nothing"
    assert len(stats.false_positives) == 0, "\n".join(map(str, stats.false_positives))


def test_indexing_ops_run_on_sharded_dtensors_like_on_one_device():
    """Real DTensor programs on a 2x2 mesh: the MoE combine (index_add of token-sharded expert outputs, summed
    without gathering them), a scatter max over a feature-sharded tensor, take with a sharded index,
    searchsorted of sharded values, embedding_bag of a column-sharded table."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    tokens, expert_out, slots = floats((6, 4), 0), floats((9, 4), 1), indices(6, (9,), 2)
    table, scatter_index, src = floats((5, 7), 3), indices(5, (3, 7), 4), floats((3, 7), 5)
    flat_index, sorted_seq, values = indices(35, (5, 3), 6), floats((11,), 7).sort().values, floats((5, 3), 8)
    bag_items, bag_offsets = indices(5, (8,), 9), torch.tensor([0, 3, 5])
    with simulated_mesh((2, 2)) as mesh:

        def shard(t, *placements):
            return distribute_tensor(t, mesh, list(placements))

        combined = torch.index_add(shard(tokens, Replicate(), Replicate()), 0, shard(slots, Shard(0), Shard(0)),
                                   shard(expert_out, Shard(0), Shard(0)))
        assert combined.placements == (Partial("sum"), Partial("sum"))
        torch.testing.assert_close(combined.full_tensor(), torch.index_add(tokens, 0, slots, expert_out))
        maxed = torch.scatter_reduce(shard(table, Shard(1), Replicate()), 0,
                                     shard(scatter_index, Shard(1), Replicate()), shard(src, Shard(1), Replicate()),
                                     "amax")
        assert maxed.placements[0] == Shard(1)
        torch.testing.assert_close(maxed.full_tensor(), torch.scatter_reduce(table, 0, scatter_index, src, "amax"))
        taken = torch.take(shard(table, Replicate(), Replicate()), shard(flat_index, Shard(0), Shard(1)))
        assert taken.placements == (Shard(0), Shard(1))
        torch.testing.assert_close(taken.full_tensor(), torch.take(table, flat_index))
        found = torch.searchsorted(shard(sorted_seq, Replicate(), Replicate()), shard(values, Shard(0), Shard(1)))
        assert found.full_tensor().equal(torch.searchsorted(sorted_seq, values))
        whole = (Replicate(), Replicate())
        bags = torch.nn.functional.embedding_bag(shard(bag_items, *whole), shard(table, Shard(1), Replicate()),
                                                 shard(bag_offsets, *whole), mode="mean")
        assert bags.placements == (Shard(1), Replicate())
        torch.testing.assert_close(bags.full_tensor(),
                                   torch.nn.functional.embedding_bag(bag_items, table, bag_offsets, mode="mean"))


def test_rules_reading_dim_are_not_reused_across_dims_from_the_propagation_cache():
    """index_add, index_copy, scatter_reduce and scatter(reduce=) pick rows by `dim` (args[1]); DTensor's cache
    hashes non-tensor args only from the schema's static_argnum on, so the rule must declare 1, or a strategy
    cached for dim=0 is reused for dim=1 on same-shaped inputs (found by the thorough OpInfo run: scatter WRONG)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    self, source = floats((4, 4), 0), floats((4, 4), 1)
    index = torch.tensor([3, 0, 2, 1])
    scatter_index = torch.tensor([[1, 0, 3, 2]] * 4)
    calls = {
        "index_add": lambda s, d, i, src: torch.index_add(s, d, i, src),
        "index_copy": lambda s, d, i, src: torch.index_copy(s, d, i, src),
        "scatter_reduce": lambda s, d, i, src: torch.scatter_reduce(s, d, i, src, "sum"),
        "scatter reduce=": lambda s, d, i, src: torch.scatter(s, d, i, src, reduce="add"),
    }
    with simulated_mesh((4,)) as mesh:
        for name, call in calls.items():
            idx = index if name.startswith("index") else scatter_index
            for dim in (0, 1):
                got = call(distribute_tensor(self, mesh, [Shard(1)]), dim, distribute_tensor(idx, mesh, [Replicate()]),
                           distribute_tensor(source, mesh, [Shard(1)]))
                torch.testing.assert_close(got.full_tensor(), call(self, dim, idx, source), msg=f"{name} dim={dim}")


def test_searchsorted_with_a_sorter_is_not_served_a_strategy_cached_without_one():
    """The rows depend on whether a sorter is given (a sequence sharded along its length counts its own smaller
    elements only without one); the sorter is a keyword, which DTensor's cache hashes only when the rule lists it
    in static_kwargkey. Found by the thorough OpInfo run: "sorter index out of range" after a sorter-less call."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    unsorted = floats((10,), 0)
    sorter, value = unsorted.argsort(), torch.tensor(-0.25, dtype=torch.float64)
    with simulated_mesh((4,)) as mesh:
        whole_value = place_dtensor(value, mesh, [Replicate()])
        plain = torch.searchsorted(place_dtensor(unsorted.sort().values, mesh, [Shard(0)]), whole_value)
        assert plain.placements == (Partial(),)  # the row a sorter must not get
        got = torch.searchsorted(place_dtensor(unsorted, mesh, [Shard(0)]), whole_value,
                                 sorter=place_dtensor(sorter, mesh, [Replicate()]))
        torch.testing.assert_close(got.full_tensor(), torch.searchsorted(unsorted, value, sorter=sorter))
        scalar = torch.searchsorted(place_dtensor(unsorted, mesh, [Shard(0)]), -0.25,
                                    sorter=place_dtensor(sorter, mesh, [Replicate()]))
        torch.testing.assert_close(scalar.full_tensor(), torch.searchsorted(unsorted, -0.25, sorter=sorter))
