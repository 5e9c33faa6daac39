"""Embedding with the rows sharded on two mesh dims (WRONG in torch 2.13) or into empty shards (error)."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext.testing import sample_tensor, simulated_mesh
from dtensor_ext.testing.mesh import place_dtensor
from tests.torch_fixes.sharded_runs import agrees

INDICES = [torch.tensor(3), torch.tensor([9, 0, 4]), torch.tensor([[1, 9], [4, 5]])]


@pytest.fixture
def restore_install():
    yield
    dtensor_ext.install()


def _inputs(mesh, weight, weight_placements, index_placements=None):
    dweight = distribute_tensor(weight, mesh, weight_placements)
    indices = []
    for index in INDICES:
        placements = index_placements if index_placements and index.dim() else [Replicate()] * mesh.ndim
        indices.append(distribute_tensor(index, mesh, placements))
    return dweight, indices


def _lookups(mesh, weight, weight_placements, index_placements=None):
    dweight, indices = _inputs(mesh, weight, weight_placements, index_placements)
    return [F.embedding(index, dweight) for index in indices]


def test_torch_alone_is_wrong_or_fails_where_the_feature_check_finds_the_defect(fixed_ops, restore_install):
    """Where the check finds no defect, torch alone must give the single-device lookups."""
    fixed = "aten::embedding.default" in fixed_ops["embedding rows sharded twice or into empty shards"]
    dtensor_ext.install(fix_torch=False)
    weight, small = sample_tensor((10, 5)), sample_tensor((5, 5))
    cases = [((2, 2), weight, [Shard(0), Shard(0)]),  # rows of the second mesh dim masked against the wrong rows
             ((4,), small, [Shard(0)])]  # 5 rows on 4 ranks: the last shard is empty
    for mesh_shape, w, placements in cases:
        with simulated_mesh(mesh_shape) as mesh:
            if fixed:
                with pytest.raises((IndexError, RuntimeError)):
                    _lookups(mesh, w, placements)
            else:
                outs = _lookups(mesh, w, placements)
                assert all(agrees(o, F.embedding(index, w)) for o, index in zip(outs, INDICES))


@pytest.mark.parametrize("mesh_shape, weight_placements", [
    ((2, 2), [Shard(0), Shard(0)]),
    ((4,), [Shard(0)]),
    ((2, 2), [Shard(0), Replicate()]),
    ((2, 2), [Partial(), Shard(0)]),
])
@pytest.mark.parametrize("rows", [10, 5, 3])
def test_lookups_give_the_one_device_rows(restore_install, mesh_shape, weight_placements, rows):
    dtensor_ext.install()
    weight = sample_tensor((rows, 4))
    expected = [F.embedding(index % rows, weight) for index in INDICES]
    with simulated_mesh(mesh_shape) as mesh:
        dweight = place_dtensor(weight, mesh, weight_placements)
        for index, want in zip(INDICES, expected):
            out = F.embedding(distribute_tensor(index % rows, mesh, [Replicate()] * mesh.ndim), dweight)
            torch.testing.assert_close(out.full_tensor(), want)


def test_layouts_torch_handled_keep_placements_and_collectives(restore_install):
    weight = sample_tensor((10, 6))
    cases = [([Shard(0), Replicate()], None), ([Replicate(), Shard(0)], None), ([Shard(1), Shard(0)], None),
             ([Replicate(), Replicate()], [Shard(0), Replicate()]), ([Shard(0), Replicate()], [Shard(0), Replicate()])]
    seen = {}
    for fix in (False, True):
        dtensor_ext.install(fix_torch=fix)
        with simulated_mesh((2, 2)) as mesh:
            for weight_placements, index_placements in cases:
                dweight, indices = _inputs(mesh, weight, weight_placements, index_placements)
                comm = CommDebugMode()
                with comm:
                    outs = [F.embedding(index, dweight) for index in indices]
                seen.setdefault(fix, []).append(([str(o.placements) for o in outs], comm.get_total_counts()))
    assert seen[True] == seen[False]


MASK_ORDER = "embedding mask outlived by a gather"
# rows sharded on one mesh dim, the indices sharded on another: the mask torch makes on the rows' mesh dim is
# outgrown by a gather of the indices' mesh dim (of the output, or of the indices themselves before the lookup)
ROWS_AND_INDICES_ON_DIFFERENT_MESH_DIMS = [
    ((2, 2), [Shard(0), Replicate()], [Replicate(), Shard(0)]),
    ((2, 2), [Shard(0), Replicate()], [Replicate(), Shard(1)]),
    ((2, 2), [Shard(0), Partial()], [Replicate(), Shard(0)]),
    ((2, 2), [Shard(0), Shard(1)], [Replicate(), Shard(1)]),
    ((2, 2, 2), [Shard(0), Replicate(), Replicate()], [Replicate(), Shard(0), Shard(1)]),
    ((2, 2, 2), [Replicate(), Shard(0), Replicate()], [Replicate(), Replicate(), Shard(0)]),
]


def _lookup(mesh_shape, weight_placements, index_placements, index_shape):
    torch.manual_seed(0)
    weight = sample_tensor((10, 6))
    index = torch.randint(0, 10, index_shape)
    with simulated_mesh(mesh_shape) as mesh:
        out = F.embedding(distribute_tensor(index, mesh, index_placements), place_dtensor(weight, mesh, weight_placements))
        return agrees(out, F.embedding(index, weight))


@pytest.mark.parametrize("mesh_shape, weight_placements, index_placements", ROWS_AND_INDICES_ON_DIFFERENT_MESH_DIMS)
@pytest.mark.parametrize("index_shape", [(4, 6), (3, 5)], ids=["even", "uneven"])
def test_rows_and_indices_on_different_mesh_dims(restore_install, mesh_shape, weight_placements, index_placements,
                                                 index_shape):
    dtensor_ext.install()
    assert _lookup(mesh_shape, weight_placements, index_placements, index_shape)


@pytest.mark.parametrize("mesh_shape, weight_placements, index_placements", ROWS_AND_INDICES_ON_DIFFERENT_MESH_DIMS)
def test_torch_alone_outgrows_the_mask_where_the_feature_check_says(fixed_ops, torch_only, mesh_shape,
                                                                     weight_placements, index_placements):
    if "aten::embedding.default" in fixed_ops[MASK_ORDER]:
        with pytest.raises(IndexError):
            _lookup(mesh_shape, weight_placements, index_placements, (4, 6))
    else:
        assert _lookup(mesh_shape, weight_placements, index_placements, (4, 6))


def test_a_mask_on_the_only_sharded_index_free_layout_stays_deferred(restore_install):
    """1-D vocabulary parallelism and an embedding dim sharded next to the mask keep torch's deferred reduction."""
    weight, index = sample_tensor((10, 6)), torch.tensor([[1, 9], [4, 5]])
    for mesh_shape, weight_placements in [((4,), [Shard(0)]), ((2, 2), [Shard(1), Shard(0)])]:
        with simulated_mesh(mesh_shape) as mesh:
            dindex = distribute_tensor(index, mesh, [Replicate()] * mesh.ndim)
            dweight = distribute_tensor(weight, mesh, weight_placements)
            with CommDebugMode() as comm:
                out = F.embedding(dindex, dweight)
            assert comm.get_total_counts() == 0 and any(p.is_partial() for p in out.placements)
            assert agrees(out, F.embedding(index, weight))


def _compiled_vocab_parallel_embedding(rank: int) -> tuple[int, list[bool]]:
    """A vocab-parallel nn.Embedding (RowwiseParallel) compiled with dynamic=True, called with three sequence
    lengths: (graphs compiled, whether each output equals one device)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(16, 8)
    weight = embedding.weight.detach().clone()
    parallelize_module(embedding, init_device_mesh("cpu", (2,)), RowwiseParallel(input_layouts=Replicate()))
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(embedding, backend=backend, dynamic=True)
    equal = []
    for length in (5, 7, 9):
        ids = torch.randint(0, 16, (2, length))
        equal.append(torch.allclose(compiled(ids), F.embedding(ids, weight)))  # a replicated plain output
    return len(graphs), equal


def test_compiled_vocab_parallel_embedding_with_dynamic_sequence_lengths():
    """Symbolic sequence lengths reach the embedding fixes' redistribution planning (unhashable SymInts before)."""
    from dtensor_ext.testing.ranks import run_ranks

    results = run_ranks(_compiled_vocab_parallel_embedding, world=2, timeout_s=200)
    assert results == {rank: (1, [True, True, True]) for rank in range(2)}


def test_the_fixes_filter_torch_strategy_and_leave_dispatch_to_dtensor(restore_install):
    """No dispatch handler: DTensor's cached propagation (its C++ fast path) runs every lookup. Where the fixes apply,
    the strategy DTensor propagates no longer offers the rows sharded twice or the mask a gather would outgrow."""
    from dtensor_ext import _compat

    dtensor_ext.install()
    op = torch.ops.aten.embedding.default
    assert _compat.custom_op_handler(op) is None
    weight, index = sample_tensor((10, 6)), torch.tensor([[1, 9], [4, 5]])
    with simulated_mesh((2, 2)) as mesh:
        twice = distribute_tensor(weight, mesh, [Shard(0), Shard(0)])
        dindex = distribute_tensor(index, mesh, [Replicate(), Replicate()])
        moved_weight = _compat.suggested_input_specs(op, (twice, dindex), {})[0]
        vocab_then_batch = distribute_tensor(index, mesh, [Replicate(), Shard(0)])
        out = F.embedding(vocab_then_batch, distribute_tensor(weight, mesh, [Shard(0), Replicate()]))
    fixes = {e.where.split(":")[1]: e.status for e in dtensor_ext.registry() if e.op == "aten::embedding.default"}
    if "fixed" in fixes.values():  # 2.11-2.15 all have both defects
        assert sum(p == Shard(0) for p in moved_weight.placements) <= 1, moved_weight
        assert agrees(out, F.embedding(index, weight))
