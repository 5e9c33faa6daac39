"""Constraints and policies that do not fit the model: one PolicyError per mistake, naming entry and field."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from dtensor_ext.models import MoEModel
from dtensor_ext.policy import (
    OpPartition,
    OpPlan,
    PolicyError,
    build_plan,
    get_called_self_module_name,
    get_layer_index,
)

SUM_OP = "%9 torch.sum in moe [torch.sum(expert_out * gates.t().unsqueeze(-1), dim=0)]"
PROJ_OP = "%0 torch.nn.functional.linear in proj [self.proj(x)]"
EINSUM_OP = '%5 torch.einsum in moe [torch.einsum("eth,ehd->etd", hidden, self.w_out)]'


def _yaml(name="torch.sum", dims='["0,0"]', parent="MoE", replica=True):
    return (f"- name: {name}\n  parent_module: {parent}\n  allowed_partition_dims: {dims}\n"
            + ("" if replica else "  replica_allowed: false\n"))


def _policy(plans):
    """A policy yielding plans(graph) (a function of the graph's nodes)."""
    def policy(graph, cfg):
        yield from plans(graph.nodes)
    return policy


@pytest.fixture
def error(mesh_1d2):
    torch.manual_seed(0)
    model, x = MoEModel(), torch.randn(6, 8)

    def build(**source) -> str:
        with pytest.raises(PolicyError) as info:
            build_plan(model, mesh_1d2, (x,), **source)
        return str(info.value)
    return build


def test_input_index_out_of_range(error):
    assert error(constraints=_yaml(dims='["1,0"]')) == (
        "<yaml> entry 0 (line 1): field 'allowed_partition_dims' got '1,0'; expected an input index of a tensor "
        f"input of {SUM_OP} (tensor inputs: [0])")


def test_dim_out_of_range(error):
    assert error(constraints=_yaml(dims='["0,-4"]')) == (
        "<yaml> entry 0 (line 1): field 'allowed_partition_dims' got '0,-4'; expected a dim in [-3, 2] for input 0 "
        f"of shape [4, 6, 8] of {SUM_OP}")


def test_op_name_matching_nothing(error):
    assert error(constraints=_yaml(name="torch.cumsum")) == (
        "<yaml> entry 0 (line 1): field 'name' got 'torch.cumsum'; expected an op the model runs: torch.Tensor.add, "
        "torch.Tensor.mul, torch.Tensor.sum, torch.Tensor.t, torch.Tensor.unsqueeze, torch.einsum, "
        "torch.nn.functional.linear, torch.relu, torch.softmax, torch.sum")


def test_parent_module_class_never_occurs(error):
    assert error(constraints=_yaml(parent="Expert")) == (
        "<yaml> entry 0 (line 1): field 'parent_module' got 'Expert'; expected a module class the model runs: "
        "Linear, MoE, MoEModel")


def test_parent_module_never_encloses_the_op(error):
    assert error(constraints=_yaml(name="torch.relu", parent="Linear")) == (
        "<yaml> entry 0 (line 1): field 'parent_module' got 'Linear'; expected a module class that runs torch.relu")


def test_unused_constraint_warns_when_asked(mesh_1d2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = build_plan(MoEModel(), mesh_1d2, (torch.randn(6, 8),),
                          constraints=_yaml(name="torch.cumsum") + _yaml(replica=False), warn_unused=True)
    assert [str(w.message).split(";")[0] for w in caught] == [
        "unused constraint <yaml> entry 0 (line 1): name 'torch.cumsum'"]
    moe_sum = next(op for op in plan.ops if op.node.fqn == "moe" and op.node.signature == "torch.sum")
    assert moe_sum.inputs[0][0].is_shard()


def test_two_constraints_for_one_op(error):
    assert error(constraints=_yaml() + _yaml(dims='["0,1"]')) == (
        "<yaml> entry 1 (line 4): field 'name' got 'torch.sum'; expected one constraint per op and mesh dim; "
        f"{SUM_OP} is already constrained on mesh dim 0 by <yaml> entry 0 (line 1)")


def test_constraints_and_policy_together(error):
    assert error(constraints=_yaml(), policy=_policy(lambda nodes: [])) == (
        "build_plan: field 'constraints/policy' got 'both'; expected at most one of constraints= (YAML) or "
        "policy= (a generator of OpPlan)")


def test_policy_yields_something_else(error):
    assert error(policy=_policy(lambda nodes: ["x"])) == (
        "policy OpPlan #0: field '<yielded>' got 'x'; expected an OpPlan")


def test_opplan_for_an_op_not_in_the_graph(error):
    assert error(policy=_policy(lambda nodes: [OpPlan(dataclasses.replace(nodes[0]))])) == (
        f"policy OpPlan #0: field 'op' got {PROJ_OP}; expected an op node of this graph (from get_pas_ops(graph))")


def test_op_planned_twice(error):
    assert error(policy=_policy(lambda nodes: [OpPlan(nodes[0]), OpPlan(nodes[0])])) == (
        f"policy OpPlan #1 for {PROJ_OP}: field 'op' got '{PROJ_OP}'; expected each op planned at most once")


def test_partition_of_wrong_type(error):
    assert error(policy=_policy(lambda nodes: [OpPlan(nodes[0], partition="shard")])) == (
        f"OpPlan for {PROJ_OP}: field 'partition' got 'shard'; expected OpPartition(input, dim), 'auto' or None")


def test_partition_dim_out_of_range(error):
    assert error(policy=_policy(lambda nodes: [OpPlan(nodes[0], partition=OpPartition(0, 5))])) == (
        f"policy OpPlan #0 for {PROJ_OP}: field 'partition' got '0,5'; expected a dim in [-2, 1] for input 0 of "
        f"shape [6, 8] of {PROJ_OP}")


def test_non_contiguous_recompute_group(error):
    plans = lambda nodes: [OpPlan(nodes[0], recompute_id=0), OpPlan(nodes[1], recompute_id=1),  # noqa: E731
                           OpPlan(nodes[2], recompute_id=0)]
    assert error(policy=_policy(plans)) == (
        "policy op %1 torch.nn.functional.linear in moe.router [self.router(x)]: field 'recompute_id' got 1; "
        "expected 0: recompute group 0 spans ops %0..%2, a group must be contiguous in execution order")


def test_recompute_group_splitting_a_module(error):
    assert error(policy=_policy(lambda nodes: [OpPlan(nodes[10], recompute_id=0)])) == (
        "policy op %10 torch.Tensor.sum in <root> [self.moe(h).sum(dim=-1, keepdim=True)]: field "
        "'recompute_id' got 0; expected groups that cover whole modules; module '<root>' also runs ops outside "
        "this group")


def test_stage_ids_going_backwards(error):
    plans = lambda nodes: [OpPlan(nodes[0], stage_id=0), OpPlan(nodes[1], stage_id=1),  # noqa: E731
                           OpPlan(nodes[10], stage_id=0)]
    assert error(policy=_policy(plans)) == (
        "policy op %10 torch.Tensor.sum in <root> [self.moe(h).sum(dim=-1, keepdim=True)]: field "
        "'stage_id' got 0; expected a stage id >= 1: stage ids may not go backwards in execution order")


def test_stage_ids_with_a_gap(error):
    assert error(policy=_policy(lambda nodes: [OpPlan(nodes[0], stage_id=0), OpPlan(nodes[5], stage_id=2)])) == (
        f"policy op {EINSUM_OP}: field 'stage_id' got 2; expected 0 or 1: stages are numbered 0, 1, 2, ... "
        "without gaps")


def test_stage_starting_inside_a_module(error):
    assert error(policy=_policy(lambda nodes: [OpPlan(nodes[0], stage_id=0), OpPlan(nodes[5], stage_id=1)])) == (
        f"policy op {EINSUM_OP}: field 'stage_id' got 1; expected a stage that begins where a submodule begins; "
        "this op runs inside 'moe' after its start")


def test_layer_index_helpers():
    assert get_layer_index("layers.3.attention.wq") == 3
    with pytest.raises(PolicyError) as info:
        get_layer_index("layers.3.experts.1")
    assert str(info.value) == ("get_layer_index('layers.3.experts.1'): field 'qualified_name' got "
                               "'layers.3.experts.1'; expected exactly one integer component, found 2")
    assert get_called_self_module_name("out = self.up_proj(x)") == "up_proj"
    assert get_called_self_module_name("torch.sum(x, dim=0)") == ""


def test_partition_with_non_integer_fields(error):
    assert error(policy=_policy(lambda nodes: [OpPlan(nodes[0], partition=OpPartition("0", 1))])) == (
        "OpPartition('0', 1): field 'input' got '0'; expected an integer input index")


def test_constraint_objects_of_wrong_type(error):
    assert error(constraints=[{"name": "torch.sum"}]) == (
        "constraints[0]: field '<item>' got {'name': 'torch.sum'}; expected a Constraint (or pass YAML text or a "
        "path)")


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 6)

    def forward(self, x, target):
        return torch.nn.functional.cross_entropy(self.head(x), target)


def test_a_partition_dtensor_cannot_run_names_what_it_would_need(mesh_1d2):
    inputs = (torch.randn(4, 4), torch.randint(0, 6, (4,)))
    with pytest.raises(PolicyError) as info:
        build_plan(_Classifier(), mesh_1d2, inputs, constraints=(
            '- name: torch.nn.functional.cross_entropy\n  allowed_partition_dims: ["0,-1"]\n'
            '  replica_allowed: false\n'))
    message = str(info.value)
    assert message.startswith(
        "<yaml> entry 0 (line 1): %1 torch.nn.functional.cross_entropy in <root> "
        "[torch.nn.functional.cross_entropy(self.head(x), target)]: field 'allowed_partition_dims' got ['0,-1']; "
        "expected a partition DTensor runs without communicating on mesh dim 0; input 0 sharded on dim 1: ")
    assert "DTensor communicates (all_gather_into_tensor x1)" in message
    assert message.endswith("Operand shards DTensor allows: none (only replicated)")
