"""Proofs for the concat family: every emitted combination on 1-D/2-D/3-D meshes, uneven and empty shards."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dtensor_ext
from dtensor_ext._compat import Partial, op_strategy_rows, tensor_meta
from dtensor_ext.rules import concat
from dtensor_ext.testing.checker import sample_tensor
from dtensor_ext.testing.mesh import simulated_mesh
from dtensor_ext.testing.strategies import shapes
from tests.rules.proof import PROVING_MESHES, assert_proven, assert_torch_validator_agrees, filled_rows

aten = torch.ops.aten


@st.composite
def cat_samples(draw):
    shape = draw(shapes(min_dims=1, max_dims=3, max_size=6))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    n = draw(st.integers(1, 3))
    tensors = []
    for i in range(n):
        own = list(shape)
        own[dim] = draw(st.integers(0, 5))
        tensors.append(sample_tensor(own, seed=i))
    if draw(st.booleans()):
        tensors.insert(draw(st.integers(0, n)), sample_tensor((0,), seed=9))  # skipped by cat whatever its rank
    return tensors, dim


@PROVING_MESHES
@given(sample=cat_samples())
def test_cat_proven(mesh_shape, sample):
    tensors, dim = sample
    assert_proven(aten.cat.default, [tensors, dim], rule=concat.cat_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=0, max_dims=3), n=st.integers(1, 3), data=st.data())
def test_stack_proven(mesh_shape, shape, n, data):
    dim = data.draw(st.integers(-len(shape) - 1, len(shape)))
    tensors = [sample_tensor(shape, seed=i) for i in range(n)]
    assert_proven(aten.stack.default, [tensors, dim], rule=concat.stack_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(lead=shapes(min_dims=0, max_dims=2), data=st.data())
def test_chunk_cat_proven(mesh_shape, lead, data):
    tails = data.draw(st.lists(shapes(min_dims=1, max_dims=2, max_size=5), min_size=1, max_size=3))
    chunks = data.draw(st.integers(1, 4))
    tensors = [sample_tensor((*lead, *tail), seed=i) for i, tail in enumerate(tails)]
    assert_proven(aten._chunk_cat.default, [tensors, len(lead), chunks], rule=concat.chunk_cat_rule,
                  mesh_shape=mesh_shape)


@PROVING_MESHES
@given(block_shapes=st.lists(shapes(min_dims=0, max_dims=2, min_size=0, max_size=4), min_size=1, max_size=3))
def test_block_diag_proven(mesh_shape, block_shapes):
    tensors = [sample_tensor(s, seed=i) for i, s in enumerate(block_shapes)]
    assert_proven(aten.block_diag.default, [tensors], rule=concat.block_diag_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(shape=shapes(min_dims=1, max_dims=3), data=st.data())
def test_unfold_proven(mesh_shape, shape, data):
    dimension = data.draw(st.integers(-len(shape), len(shape) - 1))
    size = data.draw(st.integers(1, shape[dimension]))
    step = data.draw(st.integers(1, 3))
    assert_proven(aten.unfold.default, [sample_tensor(shape), dimension, size, step], rule=concat.unfold_rule,
                  mesh_shape=mesh_shape)


ONE_D_PLACEMENTS = [Replicate(), Shard(0), Shard(1), *(Partial(r) for r in ("sum", "avg", "max", "min"))]


def _assert_covers_torch(op, rule, tensors, dim):
    """Whatever torch's op_strategy offers for any 1-D placement of the inputs, our rule offers too."""
    metas = [tensor_meta(t) for t in tensors]
    ours = {tuple((p,) for p in row) for row in filled_rows(rule, op, (metas, dim), {})}
    with simulated_mesh((2,)) as mesh:
        for placements in itertools.product(ONE_D_PLACEMENTS, repeat=len(tensors)):
            offered = op_strategy_rows(op, mesh, (tensors, dim), {}, [(p,) for p in placements])
            assert offered, f"torch offered nothing for {placements}"
            assert offered <= ours, f"torch offers {offered - ours} for inputs {placements}; ours: {ours}"


def test_cat_covers_torch_rule():
    for dim in (0, 1):
        _assert_covers_torch(aten.cat.default, concat.cat_rule, [sample_tensor((4, 6)), sample_tensor((4, 6))], dim)


def test_stack_covers_torch_rule():
    for dim in (0, 1, 2):
        _assert_covers_torch(aten.stack.default, concat.stack_rule, [sample_tensor((4, 6))] * 2, dim)


def test_torch_validator_finds_no_incorrect_rule():
    for name in ("block_diag", "unfold"):
        assert_torch_validator_agrees(name)
    # its OpInfo samples (odd channel counts) only reach combinations the validator counts as trivial
    assert_torch_validator_agrees("nn.functional.unfold", exercised=False)


def test_end_to_end_concat_keeps_shards(installed):
    """cat of row-sharded operands along dim 1 stays row-sharded; block_diag of Partial products stays Partial."""
    left, right = sample_tensor((5, 3)), sample_tensor((5, 2), seed=1)
    a, b = sample_tensor((2, 4), seed=2), sample_tensor((4, 3), seed=3)
    with simulated_mesh((2, 2)) as mesh:
        dl = distribute_tensor(left, mesh, [Shard(0), Replicate()])
        dr = distribute_tensor(right, mesh, [Shard(0), Replicate()])
        out = torch.cat([dl, dr], dim=1)
        assert out.placements == (Shard(0), Replicate())
        full = out.full_tensor()
        product = distribute_tensor(a, mesh, [Shard(1), Replicate()]) @ distribute_tensor(b, mesh, [Shard(0), Replicate()])
        assert product.placements == (Partial(), Replicate())
        diag = torch.block_diag(product, product[0])
        diag_full = diag.full_tensor()
        diag_placements = diag.placements
    torch.testing.assert_close(full, torch.cat([left, right], dim=1))
    assert diag_placements == (Partial(), Replicate())
    torch.testing.assert_close(diag_full, torch.block_diag(a @ b, (a @ b)[0]))


def test_end_to_end_upgraded_cat_and_stack():
    """With our cat/stack rules in place of torch's, mixed input placements still give the single-device result."""
    a, b = sample_tensor((4, 6)), sample_tensor((4, 6), seed=1)
    try:
        dtensor_ext.install(upgrade=["aten::cat", "aten::stack"])
        with simulated_mesh((2, 2)) as mesh:
            da = distribute_tensor(a, mesh, [Shard(1), Replicate()])
            db = distribute_tensor(b, mesh, [Replicate(), Shard(0)])
            joined = torch.cat([da, db], dim=0)
            stacked = torch.stack([da, db], dim=1)
            joined_full, stacked_full = joined.full_tensor(), stacked.full_tensor()
            joined_placements = joined.placements
    finally:
        dtensor_ext.install()
    assert Shard(0) not in joined_placements  # never sharded along the glued dim
    torch.testing.assert_close(joined_full, torch.cat([a, b], dim=0))
    torch.testing.assert_close(stacked_full, torch.stack([a, b], dim=1))


@st.composite
def im2col_samples(draw, mesh_size):
    """[N, C, H, W] or [C, H, W] with N and C multiples of the mesh size (the rule asks for even shards), and
    window parameters that leave at least one window."""
    channels = mesh_size * draw(st.integers(1, 2))
    batch = (mesh_size * draw(st.integers(1, 2)),) if draw(st.booleans()) else ()
    kernel = draw(st.lists(st.integers(1, 2), min_size=2, max_size=2))
    dilation = draw(st.lists(st.integers(1, 2), min_size=2, max_size=2))
    padding = draw(st.lists(st.integers(0, 1), min_size=2, max_size=2))
    stride = draw(st.lists(st.integers(1, 2), min_size=2, max_size=2))
    spatial = [draw(st.integers(max(1, dilation[i] * (kernel[i] - 1) + 1 - 2 * padding[i]), 4)) for i in range(2)]
    return (*batch, channels, *spatial), kernel, dilation, padding, stride


@PROVING_MESHES
@given(data=st.data())
def test_im2col_and_col2im_proven(mesh_shape, data):
    mesh_size = math.prod(mesh_shape)
    shape, *window = data.draw(im2col_samples(mesh_size))
    x = sample_tensor(shape)
    assert_proven(aten.im2col.default, [x, *window], rule=concat.im2col_rule, mesh_shape=mesh_shape)
    columns = sample_tensor(aten.im2col(x, *window).shape, seed=1)
    assert_proven(aten.col2im.default, [columns, list(shape[-2:]), *window], rule=concat.im2col_rule,
                  mesh_shape=mesh_shape)
