"""Proofs for the reductions family: count_nonzero, aminmax, hash_tensor, and the upgrades logsumexp and cumsum."""

from __future__ import annotations

import math
import re

import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext._compat import NormPartial, Partial, op_strategy_rows, tensor_meta
from dtensor_ext.rules import reductions
from dtensor_ext.testing.checker import check_combination, check_rule, sample_tensor
from dtensor_ext.testing.mesh import simulated_mesh
from dtensor_ext.testing.strategies import shapes
from tests.rules.proof import PROVING_MESHES, assert_proven, assert_torch_validator_agrees, filled_rows

aten = torch.ops.aten


@st.composite
def reduction_samples(draw, min_dims=0):
    shape = draw(shapes(min_dims=min_dims, max_dims=3))
    dims = draw(st.lists(st.integers(0, max(len(shape) - 1, 0)), unique=True, max_size=len(shape)))
    return shape, dims


@PROVING_MESHES
@given(sample=reduction_samples(), single=st.booleans())
def test_count_nonzero_proven(mesh_shape, sample, single):
    shape, dims = sample
    x = sample_tensor(shape, torch.int64, high=2)
    if single:
        op, args = aten.count_nonzero.default, [x, dims[0] if dims else None]
    else:
        op, args = aten.count_nonzero.dim_IntList, [x, dims]
    assert_proven(op, args, rule=reductions.count_nonzero_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=0, max_dims=3), data=st.data())
def test_aminmax_proven(mesh_shape, shape, data):
    dim = data.draw(st.none() | st.integers(-max(len(shape), 1), max(len(shape), 1) - 1))
    kwargs = {"dim": dim, "keepdim": data.draw(st.booleans())}
    report = check_rule(aten.aminmax.default, [sample_tensor(shape)], kwargs, mesh_shape=mesh_shape,
                        rule=reductions.aminmax_rule, search_missing=False)
    # right everywhere but where a rank holds an empty shard of a reduced dim, on which the kernel raises: the
    # layouts torch_fixes.empty_shards drops once installed (tests/torch_fixes/test_empty_shards.py runs them)
    empty_dim = "aminmax.*(over an empty dimension|dim \\d+ to have non-zero size)"
    for failure in report.failures:
        assert re.search(empty_dim, failure.reason), str(report)


@PROVING_MESHES
@given(sample=reduction_samples(), keepdim=st.booleans())
def test_hash_tensor_proven(mesh_shape, sample, keepdim):
    shape, dims = sample
    assert_proven(aten.hash_tensor.default, [sample_tensor(shape), dims], {"keepdim": keepdim},
                  rule=reductions.hash_tensor_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(sample=reduction_samples(min_dims=0), keepdim=st.booleans())
def test_logsumexp_proven(mesh_shape, sample, keepdim):
    shape, dims = sample
    args = [sample_tensor(shape), dims or [0], keepdim]
    assert_proven(aten.logsumexp.default, args, rule=reductions.logsumexp_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=1, max_dims=3), data=st.data())
def test_cumsum_proven(mesh_shape, shape, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    assert_proven(aten.cumsum.default, [sample_tensor(shape), dim], rule=reductions.cumsum_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(sample=reduction_samples(min_dims=1), keepdim=st.booleans(),
       p=st.sampled_from([None, 0, 1, 2, 0.5, 3, float("inf"), -1]), with_dtype=st.booleans())
@example(sample=((5, 3, 2), [0, 2]), keepdim=True, p=1, with_dtype=False)
@example(sample=((2, 5, 3), [1]), keepdim=False, p=2, with_dtype=False)
@example(sample=((3, 5, 2), [-1]), keepdim=False, p=0, with_dtype=True)
def test_norm_over_dims_proven(mesh_shape, sample, keepdim, p, with_dtype):
    """Surviving dims shard; a reduced dim into Partial(sum) for p in {0, 1} (inf and negative p raise on an empty
    shard). The p-norm Partial rows of other orders, which the checker cannot reassemble, are run as DTensors in
    test_norm_partial_of_a_sharded_reduced_dim."""
    shape, dims = sample
    args = [sample_tensor(shape), p, dims, keepdim]
    op, kwargs = aten.norm.ScalarOpt_dim, {}
    if with_dtype:
        op, kwargs = aten.norm.ScalarOpt_dim_dtype, {"dtype": torch.float64}

    def checkable_rows(op, args_meta, kwargs_meta):
        rows = reductions.norm_over_dims_rule(op, args_meta, kwargs_meta)
        return [row for row in rows if not isinstance(row[0], NormPartial)]

    assert_proven(op, args, kwargs, rule=checkable_rows, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(sample=reduction_samples(min_dims=1), keepdim=st.booleans(), p=st.sampled_from([None, 2, 0.5, 3]))
@example(sample=((5, 3), [0]), keepdim=False, p=2)  # 2, 2, 1, 0 rows on 4 ranks: an empty shard adds nothing
def test_norm_partial_of_a_sharded_reduced_dim(mesh_shape, sample, keepdim, p):
    """For positive finite orders other than 0 and 1, a reduced dim sharded on every mesh dim stays local: the
    result is DTensor's p-norm Partial and its full tensor is the one-device norm (uneven and empty shards too)."""
    shape, dims = sample
    reduced = reductions.reduced_dims(len(shape), dims)
    x = sample_tensor(shape)
    dtensor_ext.install()
    with simulated_mesh(mesh_shape) as mesh:
        d = distribute_tensor(x, mesh, [Shard(reduced[0])] * len(mesh_shape))
        with CommDebugMode() as comms:
            out = aten.norm.ScalarOpt_dim(d, p, dims, keepdim)
        placements, full = out.placements, out.full_tensor()
    torch.testing.assert_close(full, aten.norm.ScalarOpt_dim(x, p, dims, keepdim))
    if shape[reduced[0]] < math.prod(mesh_shape) and not _compat.RULES_KEEP_EMPTY_SHARDS:
        # torch 2.11's expansion drops every layout with a dim smaller than its number of shards: gathered first
        assert comms.get_total_counts() > 0
        return
    assert comms.get_total_counts() == 0
    assert placements == (NormPartial(2.0 if p is None else float(p)),) * len(mesh_shape)


ONE_D_PLACEMENTS = [Replicate(), Shard(0), Shard(1), Shard(2), *(Partial(r) for r in ("sum", "avg", "max", "min"))]


def _torch_offers(op, x, args):
    with simulated_mesh((2,)) as mesh:
        return {row for p in ONE_D_PLACEMENTS for row in op_strategy_rows(op, mesh, (x, *args), {}, [(p,)])}


def _ours(rule, op, x, args):
    return {tuple((p,) for p in row) for row in filled_rows(rule, op, (tensor_meta(x), *args), {})}


def test_cumsum_covers_torch_rule():
    x = sample_tensor((4, 6, 2))
    for dim in (0, 1, 2):
        assert _torch_offers(aten.cumsum.default, x, [dim]) <= _ours(reductions.cumsum_rule, aten.cumsum.default, x, [dim])


def test_logsumexp_covers_torch_rule_and_fixes_its_keepdim():
    """Without keepdim torch's rows are a subset of ours. With keepdim passed positionally (as DTensor passes it)
    torch maps the surviving dims as if they had been removed: that row is wrong, and ours replaces it."""
    op, x = aten.logsumexp.default, sample_tensor((4, 6, 2))
    dtensor_ext.install(fix_torch=False)  # torch's own rule, without dtensor_ext.torch_fixes.logsumexp_keepdim
    try:
        for dims in ([0], [1], [0, 2]):
            assert _torch_offers(op, x, [dims, False]) <= _ours(reductions.logsumexp_rule, op, x, [dims, False])
        torch_rows = _torch_offers(op, x, [[0], True])
    finally:
        dtensor_ext.install()
    assert ((Shard(0),), (Shard(1),)) in torch_rows
    reason = check_combination(op, [x, [0], True], mesh_shape=(2,), inputs=[[Shard(1)]], outputs=[[Shard(0)]])
    assert reason is not None and "shard sizes" in reason
    assert ((Shard(1),), (Shard(1),)) in _ours(reductions.logsumexp_rule, op, x, [[0], True])


def test_torch_validator_finds_no_incorrect_rule():
    assert_torch_validator_agrees("count_nonzero", max_samples=None)
    assert_torch_validator_agrees("cumsum", upgrade=["aten::cumsum"])
    # these OpInfo samples only reach combinations the validator counts as trivial: run for false positives only
    assert_torch_validator_agrees("aminmax", exercised=False)
    assert_torch_validator_agrees("logsumexp", upgrade=["aten::logsumexp"], exercised=False)
    # pairwise_distance runs sub and add before norm.ScalarOpt_dim: validate each of its aten ops. The validator
    # flags every row with DTensor's p-norm Partial output, also where DTensor's own full_tensor() gives the
    # one-device norm (test_norm_partial_of_a_sharded_reduced_dim): every other row must pass
    assert_torch_validator_agrees("nn.functional.pairwise_distance", allow_composite=True,
                                  known_false_positives={(aten.norm.ScalarOpt_dim, ("_NormP(2.0)",))})


def test_pairwise_distance_of_row_sharded_inputs_stays_local(installed):
    """F.pairwise_distance's p-norm over the features keeps unevenly sharded rows sharded, with no collective."""
    x1, x2 = sample_tensor((5, 4)), sample_tensor((5, 4), seed=1)
    with simulated_mesh((4,)) as mesh:
        d1, d2 = distribute_tensor(x1, mesh, [Shard(0)]), distribute_tensor(x2, mesh, [Shard(0)])
        with CommDebugMode() as comms:
            out = torch.nn.functional.pairwise_distance(d1, d2)
        placements, full = out.placements, out.full_tensor()
    assert comms.get_total_counts() == 0
    assert placements == (Shard(0),)
    torch.testing.assert_close(full, torch.nn.functional.pairwise_distance(x1, x2))


def test_end_to_end_reductions(installed):
    """count_nonzero over a sharded dim is a Partial sum; upgraded logsumexp with keepdim is right on a 2-D mesh."""
    ints = sample_tensor((5, 7), torch.int64, high=2)
    x = sample_tensor((4, 6, 3))
    try:
        dtensor_ext.install(upgrade=["aten::logsumexp"])
        with simulated_mesh((2, 2)) as mesh:
            counts = torch.count_nonzero(distribute_tensor(ints, mesh, [Shard(1), Shard(0)]), dim=1)
            counts_placements, counts_full = counts.placements, counts.full_tensor()
            lse = torch.logsumexp(distribute_tensor(x, mesh, [Shard(1), Shard(2)]), 0, keepdim=True)
            lse_placements, lse_full = lse.placements, lse.full_tensor()
    finally:
        dtensor_ext.install()
    assert counts_placements == (Partial("sum"), Shard(0))
    torch.testing.assert_close(counts_full, torch.count_nonzero(ints, dim=1))
    assert lse_placements == (Shard(1), Shard(2))
    torch.testing.assert_close(lse_full, torch.logsumexp(x, 0, keepdim=True))


def test_upgraded_logsumexp_runs_a_0d_input_torch_rejects():
    """torch's logsumexp rule asserts on a 0-d input reduced over dim 0 (the first OpInfo sample of logsumexp and
    masked.logsumexp: "Expected reduce_dims to not be None"); the upgraded rule shards nothing there and runs it."""
    x = sample_tensor(())
    try:
        dtensor_ext.install(upgrade=["aten::logsumexp"])
        with simulated_mesh((2, 2)) as mesh:
            out = torch.logsumexp(distribute_tensor(x, mesh, [Replicate(), Replicate()]), [0], True)
            placements, full = out.placements, out.full_tensor()
    finally:
        dtensor_ext.install()
    assert placements == (Replicate(), Replicate())
    torch.testing.assert_close(full, torch.logsumexp(x, [0], True))
