"""The traced view: op names (torch, Tensor methods, aten overloads, custom ops), modules and call expressions."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from dtensor_ext.policy import build_plan, get_called_self_module_name
from dtensor_ext.policy.trace import trace_graph
from dtensor_ext.testing import simulated_mesh


@torch.library.custom_op("dtensor_ext_policy_test::scale", mutates_args=())
def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@_scale.register_fake
def _(x, factor):
    return torch.empty_like(x)


class Inner(nn.Module):
    def forward(self, x):
        y = torch.ops.dtensor_ext_policy_test.scale(x, 2.0)
        return torch.ops.aten.sum.dim_IntList(y, [0])


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x).sum() + x.shape[0]


def test_nodes_expose_op_module_and_call_expression():
    graph = trace_graph(Outer(), (torch.randn(3, 4),))
    assert [(n.names, n.fqn, n.module_class_chain, n.call_expr) for n in graph] == [
        (("dtensor_ext_policy_test::scale",), "inner", ("Outer", "Inner"),
         "torch.ops.dtensor_ext_policy_test.scale(x, 2.0)"),
        (("aten::sum.dim_IntList", "aten::sum"), "inner", ("Outer", "Inner"),
         "torch.ops.aten.sum.dim_IntList(y, [0])"),
        (("torch.Tensor.sum", "torch.sum"), "", ("Outer",), "self.inner(x).sum()"),
        (("torch.Tensor.add", "torch.add"), "", ("Outer",), "self.inner(x).sum() + x.shape[0]"),
    ]
    assert graph.nodes[0].input_shapes == ((3, 4), None)
    assert graph.module_calls["inner"].first_op == 0 and graph.module_calls["inner"].last_op == 1


def test_constraints_match_custom_and_aten_names(mesh_1d2):
    plan = build_plan(Outer(), mesh_1d2, (torch.randn(4, 4),), constraints="""\
- name: dtensor_ext_policy_test::scale
  allowed_partition_dims: ["0,1"]
- name: aten::sum
  parent_module: Inner
  allowed_partition_dims: ["0,0"]
  replica_allowed: false
""")
    scale, total = plan.ops[0], plan.ops[1]
    # the custom op has no sharding rule: replicated (which its constraint allows), run on plain tensors
    assert scale.local and scale.inputs == ((Replicate(),),)
    assert total.node.signature == "aten::sum.dim_IntList" and total.inputs == ((Shard(0),),)


class OneLineMLP(nn.Module):
    """Hugging Face's LlamaMLP shape: three linears in one line, with no-op ops returning their input."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
        self.down_proj = nn.Linear(16, 8)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x).contiguous().to(x.dtype))


def test_call_expr_is_the_exact_call_and_no_op_returns_keep_the_dataflow():
    model, x = OneLineMLP(), torch.randn(2, 8)  # built outside the simulated mesh: inside, weights are per rank
    graph = trace_graph(model, (x,))
    linears = [n for n in graph if n.signature == "torch.nn.functional.linear"]
    assert [(n.fqn, n.call_expr, get_called_self_module_name(n.call_expr)) for n in linears] == [
        ("gate_proj", "self.gate_proj(x)", "gate_proj"),
        ("up_proj", "self.up_proj(x)", "up_proj"),
        ("down_proj", "self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x).contiguous().to("
                      "x.dtype))", "down_proj"),
    ]
    with simulated_mesh((2,)) as mesh:
        plan = build_plan(model, mesh, (x,), constraints=(
            '- name: torch.nn.functional.linear\n  allowed_partition_dims: ["1,0", "1,1"]\n  replica_allowed: false\n'))
    # the dataflow runs through contiguous() and to(): the column-parallel outputs reach down_proj still sharded
    assert {k: v for k, v in plan.params.items() if k.endswith("weight")} == {
        "gate_proj.weight": (Shard(0),), "up_proj.weight": (Shard(0),), "down_proj.weight": (Shard(1),)}
    assert [op.node.signature for op in plan.ops if op.moves] == []
