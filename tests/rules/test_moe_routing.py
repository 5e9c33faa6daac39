"""MoE routing and combine on token-sharded inputs.

torch 2.13 shards topk/sort along the expert dim of token-sharded logits and histc of sharded tokens itself;
these tests hold it to that (no collective, one-device results). The combine (scatter_add with tokens split along
the scattered dim) is ours: proven on every mesh, shown to cover torch's rule, and run end to end once upgraded.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext._compat import op_strategy_rows, tensor_meta
from dtensor_ext.rules import moe
from dtensor_ext.testing import MESH_SHAPES, simulated_mesh
from dtensor_ext.testing.checker import sample_tensor
from tests.rules.proof import PROVING_MESHES, assert_proven, assert_torch_validator_agrees, filled_rows

aten = torch.ops.aten


def test_torch_shards_the_routing_ops_itself():
    for op in (aten.topk.default, aten.sort.default, aten.sort.stable, aten.histc.default, aten.scatter_add.default):
        assert _compat.torch_strategy_kind(op) in _compat.DIRECT_STRATEGY_KINDS, op
    entries = {e.op: e for e in dtensor_ext.registry()}
    assert entries["aten::scatter_add.default"].status == "skipped"  # until install(upgrade=...) asks for it
    # no rule of the package replaces torch's (the static_args torch fix only widens torch's cache key for topk/histc)
    assert not any(e.op.startswith(("aten::topk", "aten::sort", "aten::histc", "aten::bincount"))
                   for e in entries.values() if e.family != "torch fix")


def _routing_outputs(logits, experts):
    """What a router computes from token logits [T, E]: top-2 choices, the sorted logits, and tokens per expert."""
    values, chosen = torch.topk(logits, 2, dim=-1)
    sorted_values, order = torch.sort(logits, dim=-1, stable=True)
    counts = torch.histc(chosen.float(), bins=experts, min=0, max=experts - 1)
    return values, chosen, sorted_values, order, counts


@pytest.mark.parametrize("mesh_shape", list(MESH_SHAPES.values()), ids=list(MESH_SHAPES))
def test_router_on_token_sharded_logits_needs_no_collective(mesh_shape):
    logits = torch.randn(11, 4, generator=torch.Generator().manual_seed(0))  # 11 tokens: uneven shards
    expected = _routing_outputs(logits, 4)
    with simulated_mesh(mesh_shape) as mesh:
        sharded = distribute_tensor(logits, mesh, [Shard(0)] * len(mesh_shape))
        with CommDebugMode() as comm:
            outputs = _routing_outputs(sharded, 4)
        assert comm.get_total_counts() == 0
        for out in outputs[:4]:
            assert out.placements == (Shard(0),) * len(mesh_shape)
        assert outputs[4].placements == (Partial("sum"),) * len(mesh_shape)
        for out, want in zip(outputs, expected):
            torch.testing.assert_close(out.full_tensor(), want)


@st.composite
def scatter_add_samples(draw):
    """(self, dim, index, src) with self, index and src alike off the scattered dim, as a combine has them."""
    rows, cols, scattered = draw(st.integers(1, 6)), draw(st.integers(1, 5)), draw(st.integers(0, 9))
    dim = draw(st.integers(0, 1))
    shape = (scattered, cols) if dim == 0 else (rows, scattered)
    bound = (rows, cols)[dim]
    seed = draw(st.integers(0, 100))
    index = torch.randint(0, bound, shape, generator=torch.Generator().manual_seed(seed))
    return [sample_tensor((rows, cols)), dim, index, sample_tensor(shape)]


@PROVING_MESHES
@given(args=scatter_add_samples())
def test_scatter_add_proven(mesh_shape, args):
    assert_proven(aten.scatter_add.default, args, rule=moe.scatter_add_rule, mesh_shape=mesh_shape)


@given(args=scatter_add_samples())
def test_scatter_add_covers_torch_rule(args):
    """Every row torch's rule offers is one of ours (torch's rows do not depend on the input placements)."""
    self, dim, index, src = args
    with simulated_mesh((2,)) as mesh:
        offered = op_strategy_rows(aten.scatter_add.default, mesh, args, {}, [(Replicate(),)] * 3)
    metas = [tensor_meta(self), dim, tensor_meta(index), tensor_meta(src)]
    ours = {tuple((p,) for p in row) for row in filled_rows(moe.scatter_add_rule, aten.scatter_add.default, metas, {})}
    assert offered <= ours


def _combine(out, index, src):
    return out.scatter_add(0, index, src)


def test_upgraded_combine_of_token_sharded_outputs_is_partial_without_collective():
    """Expert outputs of token-sharded routes added back into token order: torch's rule gathers index and src;
    ours keeps each rank's contributions as a Partial(sum) and issues nothing."""
    tokens, hidden = 8, 3
    index = torch.tensor([[5] * hidden, [1] * hidden, [5] * hidden, [0] * hidden,
                          [7] * hidden, [2] * hidden, [2] * hidden, [6] * hidden])
    src = sample_tensor((8, hidden))
    expected = _combine(torch.zeros(tokens, hidden), index, src)
    dtensor_ext.install(upgrade=["aten::scatter_add"])
    try:
        with simulated_mesh((2,)) as mesh:
            zeros = distribute_tensor(torch.zeros(tokens, hidden), mesh, [Partial("sum")])
            idx, values = (distribute_tensor(t, mesh, [Shard(0)]) for t in (index, src))
            with CommDebugMode() as comm:
                out = _combine(zeros, idx, values)
            assert comm.get_total_counts() == 0
            assert out.placements == (Partial("sum"),)
            torch.testing.assert_close(out.full_tensor(), expected)
    finally:
        dtensor_ext.install()
    with simulated_mesh((2,)) as mesh:
        zeros = distribute_tensor(torch.zeros(tokens, hidden), mesh, [Partial("sum")])
        idx, values = (distribute_tensor(t, mesh, [Shard(0)]) for t in (index, src))
        with CommDebugMode() as comm:
            out = _combine(zeros, idx, values)
        assert comm.get_total_counts() > 0  # torch's own rule has to move data
        torch.testing.assert_close(out.full_tensor(), expected)


def test_torch_validator_finds_no_incorrect_row_in_upgraded_scatter_add():
    assert_torch_validator_agrees("scatter_add", upgrade=["aten::scatter_add"])
