"""A write by indexing (``x[i] = v``) is an op of the plan. Python's ``Tensor.__setitem__`` returns None, so a
trace that records only ops with tensor results missed it: the plan could then hold ``x`` where DTensor cannot write
it (transformers' grouped-mm experts build an inverse permutation with ``inv[perm] = arange``; a plan that sharded
``inv`` died in DTensor's in-place check at run time) and priced nothing for it. The write is now recorded as an
in-place op of ``x``: its candidates come from DTensor like every op's, and it must write ``x`` where ``x`` is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtensor_ext.policy import PolicyError, build_plan
from dtensor_ext.policy.trace import is_inplace
from dtensor_ext.policy.trace import trace_graph
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_applied_plan_matches
from tests.policy.test_guarantee import _copies

DATA_PARALLEL = """\
- name: torch.nn.functional.linear
  allowed_partition_dims: ["0,0"]
  replica_allowed: false
"""
# the inverse permutation sharded: DTensor cannot write it there (the write's index is the whole permutation)
SHARDED_INVERSE = DATA_PARALLEL + """\
- name: torch.empty_like
  allowed_partition_dims: ["0,0"]
  replica_allowed: false
"""


class Permuted(nn.Module):
    """Rows sorted by their sum, transformed, put back in place: the inverse permutation is written by indexing."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        perm = x.sum(-1).argsort()
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0))
        return F.linear(x[perm], self.weight)[inverse]


class Masked(nn.Module):
    """Two features of every row overwritten after a linear: a write DTensor does on each row shard locally."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        h = F.linear(x, self.weight)
        h[:, :2] = 0.0
        return torch.tanh(h)


def test_the_trace_records_a_write_by_indexing_as_an_in_place_op_of_its_target():
    graph = trace_graph(Permuted(), (torch.randn(8, 16),))
    writes = [n for n in graph.nodes if n.signature == "torch.Tensor.__setitem__"]
    assert len(writes) == 1
    (write,) = writes
    empty = next(n for n in graph.nodes if n.signature == "torch.empty_like")
    assert write.operand_ids[0] == empty.output_ids[0]  # it reads the empty tensor ...
    assert write.output_ids != empty.output_ids  # ... and makes its new version, which the final index reads
    assert graph.nodes[-1].operand_ids[1] == write.output_ids[0]
    assert is_inplace(write)


def test_a_write_dtensor_cannot_do_where_the_constraints_put_its_target_is_refused_when_planning():
    model, _ = _copies(Permuted)
    x = torch.randn(32, 16)
    refused = r"^build_plan: field '<constraints>' got .*Infeasible"  # no plan: not a RuntimeError at run time
    with simulated_mesh(4) as mesh, pytest.raises(PolicyError, match=refused):
        build_plan(model, mesh, (x,), constraints=SHARDED_INVERSE)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_a_planned_write_runs_where_planned_and_equals_one_device(mesh_shape):
    model, reference = _copies(Masked)
    x = torch.randn(12, 16)  # 3 rows per rank on 4 ranks, 6 on each dp rank of 2x2
    with simulated_mesh(mesh_shape) as mesh:
        plan = build_plan(model, mesh, (x,), constraints=DATA_PARALLEL)
        (write,) = [op for op in plan.ops if op.node.signature == "torch.Tensor.__setitem__"]
        assert write.inputs[0] == write.outputs[0]  # written where it is: in place
        assert any(p.is_shard(0) for p in write.inputs[0])  # on each rank's rows: no gather for the write
        assert "torch.Tensor.__setitem__" in str(plan)
        assert_applied_plan_matches(model, reference, mesh, x, plan)
        assert plan.deviations == []


def test_the_permutation_model_planned_around_its_write_equals_one_device():
    model, reference = _copies(Permuted)
    x = torch.randn(32, 16)
    with simulated_mesh(4) as mesh:
        plan = build_plan(model, mesh, (x,), constraints=DATA_PARALLEL)
        (write,) = [op for op in plan.ops if op.node.signature == "torch.Tensor.__setitem__"]
        assert write.inputs[0] == write.outputs[0]
        assert_applied_plan_matches(model, reference, mesh, x, plan)
        assert plan.deviations == []
