import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from dtensor_ext._compat import ShardingPlaceholder
from dtensor_ext.testing import check_combination, check_rule, sample_tensor
from dtensor_ext.testing.layout import chunk_sizes, place, reassemble
from dtensor_ext.testing.strategies import mesh_shapes, placements_for, shapes

aten = torch.ops.aten
MV_ARGS = (sample_tensor((5, 7)), sample_tensor((7,), seed=1))


def wrong_mv_rule(op, args, kwargs):
    # claims: the vector sharded and the rows of the output sharded - each rank would need all of the vector
    return [[ShardingPlaceholder(0), Replicate(), ShardingPlaceholder(0)]]


def rows_only_mv_rule(op, args, kwargs):
    return [[ShardingPlaceholder(0), ShardingPlaceholder(0), Replicate()]]


def test_checker_reports_a_deliberately_wrong_rule_with_a_runnable_repro(mesh_shape):
    report = check_rule(aten.mv.default, MV_ARGS, mesh_shape=mesh_shape, rule=wrong_mv_rule)
    assert not report.ok
    assert all("S(0)" in str(f.combination) for f in report.failures)
    repro = report.failures[0].repro
    assert repro.startswith("check_combination(torch.ops.aten.mv.default, [sample_tensor((5, 7)")
    namespace = {"torch": torch, "check_combination": check_combination, "sample_tensor": sample_tensor,
                 "Shard": Shard, "Replicate": Replicate, "Partial": Partial}
    assert eval(repro, namespace) is not None  # the repro line reproduces the failure


def test_registered_wrong_rule_is_caught_through_dtensor_registration():
    import dtensor_ext
    from dtensor_ext import _compat

    previous = _compat.snapshot_registration(aten.mv.default)
    _compat.register_single_dim(aten.mv.default, wrong_mv_rule)
    try:
        report = check_rule(aten.mv.default, MV_ARGS, mesh_shape=(2,))
        assert len(report.failures) == 1
    finally:
        _compat.restore_registration(aten.mv.default, previous)
        _compat.clear_sharding_caches()
    assert check_rule(aten.mv.default, MV_ARGS, mesh_shape=(2,)).ok
    assert dtensor_ext.is_installed()


def test_missing_search_finds_the_contraction_a_rule_omits():
    report = check_rule(aten.mv.default, MV_ARGS, mesh_shape=(2,), rule=rows_only_mv_rule)
    assert report.ok
    found = {(c.inputs, c.outputs) for c in report.missing}
    assert (((Shard(1),), (Shard(0),)), ((Partial("sum"),),)) in found
    assert (((Partial("avg"),), (Replicate(),)), ((Partial("avg"),),)) in found


def test_checker_rejects_rows_of_the_wrong_width():
    import pytest

    with pytest.raises(ValueError, match="expected 3"):
        check_rule(aten.mv.default, MV_ARGS, rule=lambda op, a, k: [[Replicate(), Replicate()]])


def test_tensor_split_layout_is_not_mistaken_for_dtensor_shards():
    # 5 rows on 4 ranks: DTensor holds [2, 2, 1, 0]; pieces of [2, 1, 1, 1] concatenate to the same tensor
    full = torch.arange(10.0).reshape(5, 2)
    pieces = dict(enumerate(full.tensor_split(4)))
    try:
        reassemble(pieces, (Shard(0),), torch.arange(4), full.shape)
        raised = False
    except AssertionError as e:
        raised = "expected [2, 2, 1, 0]" in str(e)
    assert raised


@given(data=st.data(), shape=shapes(max_dims=3), mesh=mesh_shapes())
def test_place_then_reassemble_is_identity(data, shape, mesh):
    tensor = sample_tensor(shape, torch.float64)
    placements = data.draw(placements_for(len(shape), len(mesh), partial=("sum", "avg", "max", "min")))
    layout = torch.arange(torch.Size(mesh).numel()).reshape(mesh)
    coords = {int(layout[idx]): idx for idx in itertools.product(*(range(s) for s in mesh))}
    pieces = place(tensor, placements, mesh, coords)
    torch.testing.assert_close(reassemble(pieces, placements, layout, tensor.shape), tensor)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial) and mesh[mesh_dim] > 1 and tensor.numel() > 1:
            assert any(not torch.equal(pieces[r], tensor) for r in pieces), "Partial pieces must differ from the sum"


def test_chunk_sizes_follow_torch_chunk():
    for size in range(0, 12):
        for parts in (1, 2, 3, 4, 8):
            expected = [c.size(0) for c in torch.arange(size).chunk(parts)] if size else []
            got = chunk_sizes(size, parts)
            assert got[: len(expected)] == expected and sum(got) == size and len(got) == parts


def test_ops_whose_output_count_depends_on_the_shard_are_judged_not_crashed():
    # unbind along a sharded dim returns 2 tensors on one rank and 1 on the other
    report = check_rule(aten.unbind.int, (sample_tensor((3, 2)), 0), mesh_shape=(2,),
                        rule=lambda op, a, k: [[ShardingPlaceholder(0), ShardingPlaceholder(0)]])
    assert not report.ok and "different numbers of outputs" in report.failures[0].reason


def test_partial_layouts_made_inside_a_mesh_do_not_leak_into_another():
    from dtensor_ext.testing import simulated_mesh

    tensor = sample_tensor((3, 5))
    for mesh_shape in ((2,), (4,)):
        with simulated_mesh(mesh_shape):
            coords = {r: (r,) for r in range(mesh_shape[0])}
            pieces = place(tensor, (Partial("max"),), mesh_shape, coords)
        torch.testing.assert_close(reassemble(pieces, (Partial("max"),), torch.arange(mesh_shape[0]), tensor.shape),
                                   tensor)
