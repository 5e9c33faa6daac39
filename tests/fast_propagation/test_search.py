"""Fast propagation picks a strategy of the full expansion's minimum cost, and ops run correctly with it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

import dtensor_ext
from dtensor_ext import _compat, fast_propagation
from dtensor_ext._compat import LocalTensor, Partial, Replicate, Shard, StridedShard
from dtensor_ext.testing import rank_coordinates, simulated_mesh
from dtensor_ext.testing.layout import place
from tests.fast_propagation.expansion_check import CheckedExpansion, as_dtensor, expansion

aten = torch.ops.aten

# op and its input shapes as a function of sizes (m, k, n, b); the op on plain tensors is the reference
OPS = {
    "mm": (aten.mm.default, lambda m, k, n, b: [(m, k), (k, n)]),
    "addmm": (aten.addmm.default, lambda m, k, n, b: [(n,), (m, k), (k, n)]),
    "bmm": (aten.bmm.default, lambda m, k, n, b: [(b, m, k), (b, k, n)]),
    "add": (aten.add.Tensor, lambda m, k, n, b: [(m, n), (m, n)]),
    "mul": (aten.mul.Tensor, lambda m, k, n, b: [(m, n), (1, n)]),
    "mv (ours)": (aten.mv.default, lambda m, k, n, b: [(m, k), (k,)]),
    "addbmm (ours)": (aten.addbmm.default, lambda m, k, n, b: [(m, n), (b, m, k), (b, k, n)]),
}


def _single_dim(op) -> bool:
    """Whether DTensor shards `op` with a single-dim rule (torch's or ours) on the running torch: only those go
    through the expansion fast propagation replaces (torch 2.11 shards pointwise ops with an op_strategy)."""
    dtensor_ext.install()
    return _compat.torch_strategy_kind(op) == "single_dim"


def _placement_options(ndim: int):
    return st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard), st.just(Partial("sum")))


def _run_and_compare(op, tensors, placements, mesh_shape):
    expected = op(*tensors)
    with simulated_mesh(mesh_shape) as mesh, expansion(CheckedExpansion()) as recorder:
        args = [as_dtensor(t, mesh, ps, salt=i) for i, (t, ps) in enumerate(zip(tensors, placements))]
        result = op(*args).full_tensor()
    assert recorder.records, f"{op} did not go through a single-dim expansion"
    recorder.assert_min_cost(f"on mesh {mesh_shape} with inputs {placements}")
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-4)


@st.composite
def op_examples(draw, mesh_shapes):
    name = draw(st.sampled_from([name for name in sorted(OPS) if _single_dim(OPS[name][0])]))
    op, shapes_of = OPS[name]
    sizes = draw(st.tuples(*(st.integers(1, 9) for _ in range(4))))
    shapes = shapes_of(*sizes)
    mesh_shape = draw(st.sampled_from(mesh_shapes))
    placements = [
        tuple(draw(_placement_options(len(shape))) for _ in mesh_shape) for shape in shapes
    ]
    seed = draw(st.integers(0, 2**16))
    return op, shapes, mesh_shape, placements, seed


def _tensors(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]


@given(op_examples([(2,), (4,), (2, 2), (2, 2, 2)]))
def test_min_cost_and_correct_output_on_1d_to_3d_meshes(example):
    op, shapes, mesh_shape, placements, seed = example
    _run_and_compare(op, _tensors(shapes, seed), placements, mesh_shape)


@pytest.mark.parametrize(
    "name, placements",
    [
        ("mm", [(Shard(0), Replicate(), Shard(1), Partial()), (Shard(1), Shard(0), Replicate(), Partial())]),
        ("add", [(Shard(0), Shard(1), Replicate(), Shard(0)), (Shard(1), Partial(), Shard(0), Replicate())]),
        ("addbmm (ours)", [(Replicate(),) * 4, (Shard(0), Shard(2), Replicate(), Shard(1)), (Shard(0),) * 4]),
    ],
)
def test_min_cost_and_correct_output_on_4d_mesh(name, placements):
    op, shapes_of = OPS[name]
    if not _single_dim(op):
        pytest.skip(f"{op}: this torch shards it without a single-dim rule")
    _run_and_compare(op, _tensors(shapes_of(8, 6, 4, 4), seed=0), placements, (2, 2, 2, 2))


def test_in_place_op_keeps_self_and_matches_full_expansion():
    if not _single_dim(aten.add_.Tensor):
        pytest.skip("aten.add_.Tensor: this torch shards it without a single-dim rule")
    a, b = _tensors([(6, 4), (6, 4)], seed=1)
    expected = a + b
    with simulated_mesh((2, 2)) as mesh, expansion(CheckedExpansion()) as recorder:
        da = as_dtensor(a, mesh, (Shard(0), Shard(1)), salt=0)
        db = as_dtensor(b, mesh, (Shard(1), Replicate()), salt=1)
        da.add_(db)
        result = da.full_tensor()
    assert da.placements == (Shard(0), Shard(1))
    assert recorder.records
    recorder.assert_min_cost("in place on (S0, S1)")
    torch.testing.assert_close(result, expected)


def test_strided_shard_input_falls_back_to_full_expansion(monkeypatch):
    calls = []
    full = _compat.full_single_dim_expansion

    def spy(*args):
        calls.append(args[1].op)
        return full(*args)

    monkeypatch.setattr(_compat, "full_single_dim_expansion", spy)
    a, b = _tensors([(8, 4), (4, 4)], seed=2)
    with simulated_mesh((2, 2)) as mesh, fast_propagation.fast_propagation():
        placements = (StridedShard(0, split_factor=2), Shard(0))
        da = DTensor.from_local(
            LocalTensor(place(a, (Replicate(), Replicate()), (2, 2), rank_coordinates(mesh))),
            mesh,
            (Replicate(), Replicate()),
            run_check=False,
        ).redistribute(mesh, placements)
        db = DTensor.from_local(
            LocalTensor(place(b, (Replicate(), Replicate()), (2, 2), rank_coordinates(mesh))),
            mesh,
            (Replicate(), Replicate()),
            run_check=False,
        )
        calls.clear()
        result = torch.mm(da, db).full_tensor()
    assert calls == [aten.mm.default]
    torch.testing.assert_close(result, a @ b)


def test_enable_disable_restore_torch_exactly_and_clear_caches(monkeypatch):
    was_enabled = fast_propagation.is_enabled()  # the suite may run with fast propagation on
    fast_propagation.disable()
    cleared = []
    # patched where set_single_dim_expansion looks it up
    monkeypatch.setattr(_compat.propagation, "clear_sharding_caches", lambda: cleared.append(True))
    try:
        original = _compat.single_dim_expansion()
        assert original is _compat.full_single_dim_expansion
        with fast_propagation.fast_propagation():
            assert fast_propagation.is_enabled()
            with fast_propagation.fast_propagation():  # nested: stays on, and the outer block still owns disabling
                assert fast_propagation.is_enabled()
            assert fast_propagation.is_enabled()
        assert _compat.single_dim_expansion() is original
        assert not fast_propagation.is_enabled()
        assert len(cleared) == 2

        fast_propagation.enable()
        fast_propagation.enable()
        fast_propagation.disable()
        fast_propagation.disable()
        assert _compat.single_dim_expansion() is original
        assert len(cleared) == 4
    finally:
        if was_enabled:
            fast_propagation.enable()


def _bound_and_cost(mesh_shape, shape, source_placements, target_placements) -> tuple[float, float, float]:
    """(sum of the per-mesh-dim leave bounds, the whole-move bound, torch's redistribute_cost)."""
    meta = _compat.tensor_meta(torch.empty(shape))
    with simulated_mesh(mesh_shape) as mesh:
        source = _compat.DTensorSpec(mesh, source_placements, tensor_meta=meta)
        target = _compat.DTensorSpec(mesh, target_placements, tensor_meta=meta)
        topo = _compat.MeshTopoInfo.build_from_mesh(mesh)
        bound = fast_propagation._LeaveBound(mesh, topo, source, frozenset(range(len(shape))))
        lower = sum(bound.leave(dim, p) for dim, p in enumerate(target_placements))
        return lower, bound.lower(target_placements), _compat.redistribute_cost(source, target)


@given(
    mesh_shape=st.sampled_from([(4,), (2, 3), (2, 2, 2), (2, 2, 2, 2)]),
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    data=st.data(),
)
def test_bound_never_exceeds_torchs_redistribute_cost(mesh_shape, shape, data):
    """The lemma the search rests on: per mesh dim, leaving a source costs at least the bound, whatever the target."""
    source = tuple(data.draw(_placement_options(len(shape))) for _ in mesh_shape)
    target = tuple(data.draw(_placement_options(len(shape))) for _ in mesh_shape)
    leave, lower, cost = _bound_and_cost(mesh_shape, shape, source, target)
    assert leave <= cost * (1 + 1e-12), f"{source} -> {target}: leave bound {leave} > cost {cost}"
    assert lower <= cost * (1 + 1e-12), f"{source} -> {target}: whole-move bound {lower} > cost {cost}"
    if _compat.placement_transition_cost() is not None:  # greedy's plan priced step by step: the price itself
        assert math.isclose(lower, cost, rel_tol=1e-12), f"{source} -> {target}: bound {lower} != cost {cost}"


def test_bound_allows_greedy_detour_through_replicate():
    """(S1, S0) -> (R, S1): greedy gathers mesh dim 1 instead of an all-to-all, since dim 1 nests under mesh dim 0."""
    leave, lower, cost = _bound_and_cost((2, 3), (4, 4), (Shard(1), Shard(0)), (Replicate(), Shard(1)))
    assert leave <= lower <= cost * (1 + 1e-12)


@pytest.mark.parametrize(
    "shape, mesh_shape, placements",
    [((5, 6), (2, 2), (Shard(0), Shard(1))), ((6, 4), (4,), (Shard(0),)), ((3, 5), (2, 2), (Shard(1), Shard(1)))],
)
def test_mean_of_uneven_and_empty_shards_is_right(shape, mesh_shape, placements):
    """torch 2.14+ rejects Partial(avg) over uneven shards with the rule's full-mesh filter; the search must too
    (it returned 16.0 for 14.5, and NaN where a shard is empty)."""
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    with simulated_mesh(mesh_shape) as mesh, expansion(CheckedExpansion()) as recorder:
        result = as_dtensor(x, mesh, placements, salt=0).mean().full_tensor()
    recorder.assert_min_cost(f"mean on {mesh_shape} {placements}")
    torch.testing.assert_close(result, x.mean())
