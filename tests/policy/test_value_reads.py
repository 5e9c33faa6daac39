"""A call that hands a tensor's values to Python (``bool(t)``, ``t.item()``, ``int(t)``, ``t.tolist()``) is an op of
the plan. It returns no tensor, so a trace that records only ops with tensor results missed it: the plan could leave
the value sharded or a Partial sum, and Python then read one rank's part (a token count taken with ``.item()`` of a
batch-sharded mask was rank 0's count, and the output off by 1.9e-3, silently). The read is now recorded as an op
with no output that needs the whole value: the plan moves it there (an all-reduce of a Partial sum) and says so."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from dtensor_ext.policy import PolicyError, build_plan, parallelize
from dtensor_ext.policy.trace import trace_graph
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.tools.comm_stats import CommStatsMode
from tests.policy.checks import assert_applied_plan_matches, assert_every_rank_matches
from tests.policy.gloo_ranks import spawn_ranks
from tests.policy.test_guarantee import _copies

WORLD = 4
DATA_PARALLEL = """\
- name: torch.nn.functional.linear
  allowed_partition_dims: ["0,0"]
  replica_allowed: false
"""


class Counted(nn.Module):
    """Divides by counts Python reads from a batch-sharded activation: a scalar by `.item()`, a branch by
    `bool()`, the largest per-feature count by `int()`."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        positive = (h > 0).sum().item()
        if (h.abs() < 10).all():  # true on one device; every rank must take the same branch
            h = h * 2
        return self.b(torch.relu(h)) / positive / self.per_feature(h)

    def per_feature(self, h):
        return int((h > 0).sum(0).max())


class CountedByList(Counted):
    """Per-feature counts read by `.tolist()` (which simulated ranks cannot run: real gloo ranks do)."""

    def per_feature(self, h):
        return torch.tensor((h > 0).sum(0).tolist(), dtype=h.dtype) + 1


def test_the_trace_records_each_read_as_an_op_with_no_output():
    graph = trace_graph(CountedByList(), (torch.randn(8, 16),))
    reads = [n for n in graph.nodes if n.reads_values]
    assert [n.signature for n in reads] == ["torch.Tensor.item", "torch.Tensor.__bool__", "torch.Tensor.tolist"]
    assert [n.signature for n in trace_graph(Counted(), (torch.randn(8, 16),)).nodes if n.reads_values][-1] == (
        "torch.Tensor.__int__")
    assert all(n.output_ids == () and len(n.operand_ids) == 1 for n in reads)
    # metadata is not a read: size() and shape hand no values over
    assert not any(n.signature.endswith(("size", "dim")) for n in graph.nodes)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_reads_see_the_whole_value_and_the_plan_lists_the_moves(mesh_shape):
    """Data parallel linears shard h by rows; each read gets the whole value, so every rank computes the single
    device's output and gradients. The forward runs exactly the collectives the plan lists."""
    torch.manual_seed(0)
    reference, model = _copies(Counted)
    x = torch.randn(8, 16)
    with simulated_mesh(mesh_shape) as mesh:
        plan = build_plan(model, mesh, (x,), constraints=DATA_PARALLEL)
        reads = [op for op in plan.ops if op.node.reads_values]
        assert len(reads) == 3 and all(op.local for op in reads)
        assert all(p.is_replicate() for op in reads for placements in op.inputs for p in placements)
        assert "reads the value into Python, replicated" in str(plan)
        listed = Counter(kind for kind, _ in plan.forward_collectives())
        assert listed  # the reads' values are sharded or Partial: they are gathered or reduced first
        assert_applied_plan_matches(model, reference, mesh, x, plan)
        with CommStatsMode() as stats:
            model(x)
        assert Counter(dict(stats.stats.collectives)) == listed
        assert not plan.deviations


def test_a_read_cannot_be_partitioned():
    constraints = DATA_PARALLEL + """\
- name: torch.Tensor.tolist
  allowed_partition_dims: ["0,0"]
  replica_allowed: false
"""
    with simulated_mesh((4,)) as mesh, pytest.raises(PolicyError, match=r"replica_allowed.*hands the value to "
                                                                        r"Python"):
        build_plan(CountedByList(), mesh, (torch.randn(8, 16),), constraints=constraints)


def _rank_main(rank: int, init_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dtensor_ext.policy import parallelize

    torch.set_num_threads(1)  # four ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        reference, model = _copies(CountedByList)
        x = torch.randn(8, 16)
        parallelize(model, init_device_mesh("cpu", (WORLD,)), (x,), constraints=DATA_PARALLEL)
        out, expected = model(x), reference(x)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
        out.square().sum().backward()
        expected.square().sum().backward()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(dict(model.named_parameters())[name].grad.full_tensor(), p.grad, atol=1e-5,
                                       rtol=1e-4)
    finally:
        dist.destroy_process_group()


def test_reads_on_four_gloo_ranks(tmp_path):
    """Each real rank reads the whole value (.item(), bool(), .tolist()), so they agree with one device."""
    spawn_ranks(_rank_main, WORLD, tmp_path)


class Branchy(nn.Module):
    """Scales by a count only where asked: the example inputs do not take the branch, so the trace has no read."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, by_count):
        h = self.a(x)
        if by_count.any():
            h = h / (h > 0).sum().item()
        return self.b(h)


def test_a_read_the_trace_did_not_see_gets_the_whole_value_and_is_listed():
    torch.manual_seed(0)
    reference, model = _copies(Branchy)
    x = torch.randn(8, 16)
    with simulated_mesh((4,)) as mesh:
        plan = build_plan(model, mesh, (x, torch.tensor(False)), constraints=DATA_PARALLEL)
        parallelize(model, mesh, (x, torch.tensor(False)), plan=plan)
        assert_every_rank_matches(model(x, torch.tensor(True)), reference(x, torch.tensor(True)))
        assert any(d.startswith("unplanned read item of a value at (Partial(sum),)") for d in plan.deviations)
