"""F.embedding(..., max_norm=) of a sharded weight: the in-place renorm is exact, keeps the weight's layout, and
moves nothing where the rows are sharded and the indices replicated."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from dtensor_ext.testing import place_dtensor, sample_tensor, simulated_mesh
from tests.torch_fixes.sharded_runs import agrees

FIX = "embedding max_norm of a sharded weight"
OP = "aten::embedding_renorm_.default"
REFUSAL = "in-place operations that require placement changes"
MAX_NORM = 1.5
# rows named twice, first and last rows; every row norm of sample_tensor((rows, 6)) is above MAX_NORM for some
INDICES = torch.tensor([[0, 3, 9, 3], [4, 5, 6, 1], [2, 2, 8, 7]])
WEIGHT_LAYOUTS = [Replicate(), Shard(0), Shard(1), Partial()]


def _expected(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weight = sample_tensor((rows, 6)) * 3
    indices = INDICES % rows
    renormed = weight.clone()
    out = F.embedding(indices, renormed, max_norm=MAX_NORM)
    assert not torch.equal(renormed, weight)  # the case renorms something
    return weight, indices, (out, renormed)


def _check(mesh, rows, weight_placements, index_placements):
    weight, indices, (out, renormed) = _expected(rows)
    dweight = place_dtensor(weight, mesh, weight_placements)
    # a view of the weight along a dim it is not sharded on (selecting from a sharded dim gathers: a copy, no view)
    sharded = {p.dim for p in weight_placements if isinstance(p, Shard)}
    select = next((lambda t, d=d: t.select(d, 1) for d in (1, 0) if d not in sharded), None)
    view = select(dweight) if select else None
    view_placements = view.placements if select else None
    got = F.embedding(distribute_tensor(indices, mesh, index_placements), dweight, max_norm=MAX_NORM)
    assert dweight.placements == tuple(weight_placements)
    assert agrees(got, out) and agrees(dweight, renormed)
    if select:
        assert view.placements == view_placements and agrees(view, select(renormed))


@pytest.mark.parametrize("rows", [10, 5, 3], ids=["10 rows", "5 rows (an empty shard on 4)", "3 rows"])
@pytest.mark.parametrize("index_placements", [[Replicate()], [Shard(0)], [Shard(1)]], ids=str)
def test_every_weight_layout_on_1d(rows, index_placements):
    with simulated_mesh((4,)) as mesh:
        for layout in WEIGHT_LAYOUTS:
            _check(mesh, rows, [layout], index_placements)


@pytest.mark.parametrize("rows", [10, 5], ids=["10 rows", "5 rows"])
@pytest.mark.parametrize("index_placements", [[Replicate(), Replicate()], [Shard(0), Replicate()],
                                              [Replicate(), Shard(1)]], ids=str)
def test_every_weight_layout_on_2x2(rows, index_placements):
    with simulated_mesh((2, 2)) as mesh:
        for layout in itertools.product(WEIGHT_LAYOUTS, repeat=2):
            _check(mesh, rows, list(layout), index_placements)


@pytest.mark.parametrize("weight_placements", [[Shard(0), Replicate(), Shard(1)], [Partial(), Shard(0), Shard(0)],
                                               [Shard(1), Shard(0), Partial()]], ids=str)
def test_weight_layouts_on_2x2x2(weight_placements):
    with simulated_mesh((2, 2, 2)) as mesh:
        _check(mesh, 10, weight_placements, [Shard(0), Replicate(), Shard(1)])


@pytest.mark.parametrize("mesh_shape, weight_placements", [((4,), [Shard(0)]), ((2, 2), [Shard(0), Replicate()]),
                                                           ((2, 2), [Replicate(), Shard(0)])], ids=str)
def test_rows_sharded_and_indices_replicated_move_nothing(mesh_shape, weight_placements):
    weight, indices, (_, renormed) = _expected(10)
    with simulated_mesh(mesh_shape) as mesh:
        dweight = place_dtensor(weight, mesh, weight_placements)
        dindices = distribute_tensor(indices, mesh, [Replicate()] * mesh.ndim)
        with CommDebugMode() as comm:
            torch.embedding_renorm_(dweight, dindices, MAX_NORM, 2.0)
        assert comm.get_total_counts() == 0
        assert agrees(dweight, renormed)


def test_torch_alone_refuses_where_the_feature_check_finds_the_defect(fixed_ops, torch_only):
    weight, indices, (out, renormed) = _expected(10)
    with simulated_mesh((4,)) as mesh:
        dweight = place_dtensor(weight, mesh, [Shard(0)])
        dindices = distribute_tensor(indices, mesh, [Replicate()])
        if OP in fixed_ops[FIX]:
            with pytest.raises(RuntimeError, match=REFUSAL):
                F.embedding(dindices, dweight, max_norm=MAX_NORM)
        else:
            assert agrees(F.embedding(dindices, dweight, max_norm=MAX_NORM), out) and agrees(dweight, renormed)
