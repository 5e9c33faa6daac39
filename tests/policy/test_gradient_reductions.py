"""A value's Partial gradients are summed over its readers and reduced once, straight into the value's placement: the
plan prices and lists that reduction by where the value is (a reduce-scatter into a sequence shard, an all-reduce
into a replicated value) and the backward runs exactly what it lists. Before, the plan priced and listed an
all-reduce, while each moved reader's gradient was reduced on its own by DTensor's redistribute backward: q, k and
v reading one sequence-sharded norm output listed one all-reduce and ran three reduce-scatters."""

from __future__ import annotations

import copy
import re
from collections import Counter

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from dtensor_ext._compat import StridedShard
from dtensor_ext.policy import build_plan, parallelize
from dtensor_ext.policy.gradients import reduction_stops
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.tools.comm_stats import CommStatsMode
from tests.policy.checks import assert_every_rank_matches


class NormThenThree(nn.Module):
    """A norm's output read by three projections, as attention's q, k and v read the normed hidden states."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(8)
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8, bias=False) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        return self.o(self.q(h) * self.k(h) + self.v(h))


# the norm runs on sequence shards, the projections column/row-parallel: the sequence-parallel layout
SEQUENCE_PARALLEL = """\
- name: torch.nn.functional.linear
  allowed_partition_dims: ["1,0", "1,1"]
  replica_allowed: false
- name: torch.nn.functional.rms_norm
  allowed_partition_dims: ["0,1"]
  replica_allowed: false
"""


class NormThenTwoAndResidual(nn.Module):
    """The norm's output also read by an op that sends back a whole gradient (a sequence-sharded `h * 2`)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(8)
        self.q, self.k, self.o = (nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x):
        h = self.norm(x)
        return self.o(self.q(h) * self.k(h)) + h * 2


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
@pytest.mark.parametrize("factory", [NormThenThree, NormThenTwoAndResidual], ids=["three", "two-and-residual"])
def test_the_readers_partial_gradients_are_reduce_scattered_once(factory, mesh_shape):
    """With a reader that sends a whole gradient beside them (two-and-residual), autograd met q's Partial
    gradient, then the whole one, then k's, and DTensor's add reduce-scattered twice: the Partial readers now read
    the value through their group's step, whose backward reduces their sum once (policy.gradients)."""
    torch.manual_seed(0)
    model, x = factory(), torch.randn(4, 8, 8)
    reference = copy.deepcopy(model)
    expected = reference(x)
    expected.square().sum().backward()
    names = ("dp", "tp") if len(mesh_shape) == 2 else None
    with simulated_mesh(mesh_shape, mesh_dim_names=names) as mesh:
        plan = build_plan(model, mesh, (x,), constraints=SEQUENCE_PARALLEL)
        norm_out = next(op for op in plan.ops if op.node.fqn == "norm").node.output_ids[0]
        assert plan.graph.tensors[norm_out].shape == x.shape
        assert all(p.is_shard(1) for p in next(op for op in plan.ops if op.node.fqn == "norm").outputs[0][-1:])
        listed = plan.backward_collectives()
        # the norm output's gradient: one reduce-scatter of the sum of q's, k's and v's Partial gradients
        assert re.search(r"reduce the Partial gradient of \[4, 8, 8\]( \(one group of readers\))?: "
                         r"\((R, )?P\) -> \((R, )?S\(1\)\): reduce_scatter", str(plan)), str(plan)
        parallelize(model, mesh, (x,), plan=plan)
        out = model(x)
        assert_every_rank_matches(out, expected)
        with CommStatsMode() as comm:
            out.square().sum().backward()
        ran = comm.stats
        assert dict(ran.collectives) == dict(Counter(kind for kind, _ in listed)), str(plan)
        assert str(plan).count("reduce the Partial gradient of [4, 8, 8]") == 1, str(plan)
        assert not {"q", "k", "v"} & set(plan.styles)  # a style's input hook would reduce each reader apart
        assert dict(ran.received_bytes) == {kind: sum(b for k, b in listed if k == kind) for kind in ran.collectives}
        for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
            assert_every_rank_matches(param.grad.full_tensor(), ref.grad)
            assert param.grad.placements == param.placements, name


def test_the_reduction_goes_straight_into_the_values_placement():
    r, p = Replicate(), Partial()
    assert reduction_stops((Shard(1),), {0}) == [(p,), (Shard(1),)]
    assert reduction_stops((r, Shard(0)), {0, 1}) == [(p, p), (r, Shard(0))]
    assert reduction_stops((p,), {0}) == [(p,), (r,)]  # a Partial value's gradient is whole
    # DTensor cannot reduce-scatter into a strided shard: all-reduced, then cut
    strided = StridedShard(0, split_factor=2)
    assert reduction_stops((strided, Shard(1)), {0}) == [(p, Shard(1)), (r, Shard(1)), (strided, Shard(1))]
